package datastorelock

import (
	"context"
	"fmt"
	"time"

	pb "cloud.google.com/go/datastore/apiv1/datastorepb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"
)

// retry runs op until it succeeds, fails in a way a retry cannot fix, or
// the budget (WithRetries) or ctx runs out, with the jittered waits of the
// shared backoff between attempts. An error that ctx's end cut short wraps
// both ctx.Err() and op's error, so errors.Is sees the context's error
// through gRPC's status.
func (b *Backend) retry(ctx context.Context, op func() error) error {
	return b.policy.Do(ctx, func(int) error { return op() }, retryable)
}

// retryable reports whether an RPC that failed with err is sent again
// (doclock.Retryable: the transient codes).
func retryable(err error) bool { return doclock.Retryable(uint32(status.Code(err))) }

// requests are the Backend's RPCs as the shared lock asks for them.
type requests struct{ b *Backend }

// Read is a Lookup of key's entity.
func (q requests) Read(ctx context.Context, key string) (doclock.Record, bool, doclock.Reading, error) {
	return q.b.lookupKey(ctx, q.b.dsKey(key))
}

// Create is a Commit of an insert: AlreadyExists when the entity exists.
func (q requests) Create(ctx context.Context, key string, r doclock.Record) (int64, time.Time, error, error) {
	v, _, at, lost, err := q.b.write(ctx, insert(q.b.entity(key, r)))
	if status.Code(err) == codes.AlreadyExists {
		err = fmt.Errorf("%w: %w", doclock.ErrExists, err)
	}
	return v, at, lost, err
}

// Update is a Commit of an update with base_version base: a conflict, or
// NotFound for an entity deleted since, does not apply.
func (q requests) Update(ctx context.Context, key string, r doclock.Record, base int64) (int64, bool, time.Time, error, error) {
	v, applied, at, lost, err := q.b.write(ctx, update(q.b.entity(key, r), base))
	if status.Code(err) == codes.NotFound {
		return 0, false, at, lost, nil
	}
	return v, applied, at, lost, err
}

// tsTime is ts as a time, zero when ts is missing or invalid.
func tsTime(ts *timestamppb.Timestamp) time.Time {
	if ts == nil || !ts.IsValid() {
		return time.Time{}
	}
	return ts.AsTime()
}

// lookupKey reads the record of entity key k; found is false when it does
// not exist. rd is the instant to judge it by (see doclock.Clock.Judge).
func (b *Backend) lookupKey(ctx context.Context, k *pb.Key) (r doclock.Record, found bool, rd doclock.Reading, err error) {
	err = b.retry(ctx, func() error {
		sent := b.now()
		res, err := b.rpc.Lookup(b.ctx(ctx), &pb.LookupRequest{
			ProjectId:  b.project,
			DatabaseId: b.database,
			Keys:       []*pb.Key{k},
		})
		if err != nil {
			return err
		}
		recv := b.now()
		b.clock.Observe(tsTime(res.GetReadTime()), sent, recv, true)
		if rd, err = b.clock.Judge(tsTime(res.GetReadTime()), recv); err != nil {
			return err
		}
		if len(res.Deferred) > 0 {
			return status.Error(codes.Unavailable, "lookup deferred the key")
		}
		if len(res.Found) == 0 {
			found = false
			return nil
		}
		r, err = decode(res.Found[0])
		found = err == nil
		return err
	})
	return r, found, rd, err
}

// probeName is an entity name that Name never returns ("!" is not in the
// base64url alphabet): PurgeExpired reads it for the server's time.
const probeName = "~probe!"

// probe reads the server's time (or learns that the service gives none).
func (b *Backend) probe(ctx context.Context) error {
	k := b.dsKey("")
	k.Path[0].IdType = &pb.Key_PathElement_Name{Name: probeName}
	_, _, _, err := b.lookupKey(ctx, k)
	return err
}

// commitTime is the server's time in a Commit reply: commit_time, else the
// latest update_time of an applied mutation (a conflicting one reports the
// entity's older update time), else nil.
func commitTime(res *pb.CommitResponse) *timestamppb.Timestamp {
	if ts := res.GetCommitTime(); ts != nil {
		return ts
	}
	var latest *timestamppb.Timestamp
	for _, mr := range res.GetMutationResults() {
		ts := mr.GetUpdateTime()
		if mr.GetConflictDetected() || ts == nil || !ts.IsValid() {
			continue
		}
		if latest == nil || ts.AsTime().After(latest.AsTime()) {
			latest = ts
		}
	}
	return latest
}

// mayHaveApplied reports whether a Commit that failed with err may have
// been applied all the same (doclock.MayHaveApplied).
func mayHaveApplied(err error) bool { return doclock.MayHaveApplied(uint32(status.Code(err))) }

// write commits one mutation outside any transaction and returns the
// entity's new version and the commit's server time (zero when the reply
// carries none); applied is false when base_version conflicted.
// AlreadyExists (an insert of an existing key) is returned as is. lost is
// the error of the latest attempt that failed in a way that leaves open
// whether the server applied it: then the mutation may have applied even
// when err is set or applied is false (a retry finds its own write).
func (b *Backend) write(ctx context.Context, m *pb.Mutation) (version int64, applied bool, at time.Time, lost, err error) {
	err = b.retry(ctx, func() error {
		sent := b.now()
		res, err := b.rpc.Commit(b.ctx(ctx), &pb.CommitRequest{
			ProjectId:  b.project,
			DatabaseId: b.database,
			Mode:       pb.CommitRequest_NON_TRANSACTIONAL,
			Mutations:  []*pb.Mutation{m},
		})
		if err != nil {
			if mayHaveApplied(err) {
				lost = err
			}
			return err
		}
		at = tsTime(commitTime(res))
		b.clock.Observe(at, sent, b.now(), false)
		if len(res.MutationResults) != 1 {
			return fmt.Errorf("commit returned %d mutation results, want 1", len(res.MutationResults))
		}
		mr := res.MutationResults[0]
		version, applied = mr.Version, !mr.ConflictDetected
		return nil
	})
	return version, applied, at, lost, err
}

func insert(e *pb.Entity) *pb.Mutation {
	return &pb.Mutation{Operation: &pb.Mutation_Insert{Insert: e}}
}

func update(e *pb.Entity, base int64) *pb.Mutation {
	return &pb.Mutation{
		Operation:                 &pb.Mutation_Update{Update: e},
		ConflictDetectionStrategy: &pb.Mutation_BaseVersion{BaseVersion: base},
	}
}
