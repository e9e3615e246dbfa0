package firestorelock

import (
	"context"
	"fmt"
	"io"
	"time"

	pb "cloud.google.com/go/firestore/apiv1/firestorepb"
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

// Read reads key's document.
func (q requests) Read(ctx context.Context, key string) (doclock.Record, bool, doclock.Reading, error) {
	return q.b.lookupName(ctx, q.b.docName(key))
}

// Create is a Commit of a write preconditioned on exists=false.
func (q requests) Create(ctx context.Context, key string, r doclock.Record) (int64, time.Time, error, error) {
	v, _, at, lost, err := q.b.write(ctx, create(q.b.document(key, r)))
	return rev(v), at, lost, err
}

// Update is a Commit of a write preconditioned on the update time base.
func (q requests) Update(ctx context.Context, key string, r doclock.Record, base int64) (int64, bool, time.Time, error, error) {
	v, applied, at, lost, err := q.b.write(ctx, update(q.b.document(key, r), unrev(base)))
	return rev(v), applied, at, lost, err
}

// tsTime is ts as a time, zero when ts is missing or invalid.
func tsTime(ts *timestamppb.Timestamp) time.Time {
	if ts == nil || !ts.IsValid() {
		return time.Time{}
	}
	return ts.AsTime()
}

// lookupName reads the document name with one BatchGetDocuments call,
// whose reply carries the read_time the record is judged by.
func (b *Backend) lookupName(ctx context.Context, name string) (r doclock.Record, found bool, rd doclock.Reading, err error) {
	return b.lookup(ctx, name, nil)
}

// lookup is lookupName in transaction tx (none when nil). In a
// transaction, Aborted is not retried: the transaction is over.
func (b *Backend) lookup(ctx context.Context, name string, tx []byte) (r doclock.Record, found bool, rd doclock.Reading, err error) {
	req := &pb.BatchGetDocumentsRequest{Database: b.db, Documents: []string{name}}
	again := retryable
	if tx != nil {
		req.ConsistencySelector = &pb.BatchGetDocumentsRequest_Transaction{Transaction: tx}
		again = func(err error) bool { return status.Code(err) != codes.Aborted && retryable(err) }
	}
	err = b.policy.Do(ctx, func(int) error {
		sent := b.now()
		cctx, cancel := context.WithCancel(b.ctx(ctx))
		defer cancel()
		stream, err := b.rpc.BatchGetDocuments(cctx, req)
		if err != nil {
			return err
		}
		var res *pb.BatchGetDocumentsResponse
		for res == nil || res.Result == nil {
			m, err := stream.Recv()
			if err == io.EOF {
				return status.Error(codes.Unavailable, "firestorelock: the read ended without a result")
			}
			if err != nil {
				return err
			}
			res = m
		}
		recv := b.now()
		b.clock.Observe(tsTime(res.GetReadTime()), sent, recv, true)
		if rd, err = b.clock.Judge(tsTime(res.GetReadTime()), recv); err != nil {
			return err
		}
		doc := res.GetFound()
		if doc == nil {
			found = false
			return nil
		}
		r, err = decode(doc)
		found = err == nil
		return err
	}, again)
	return r, found, rd, err
}

// probeID is a document ID that Name never returns ("!" is not in the
// base64url alphabet): PurgeExpired reads it for the server's time.
const probeID = "~probe!"

// probe reads the server's time (or learns that the service gives none).
func (b *Backend) probe(ctx context.Context) error {
	_, _, _, err := b.lookupName(ctx, b.docs+probeID)
	return err
}

// mayHaveApplied reports whether a Commit that failed with err may have
// been applied all the same (doclock.MayHaveApplied).
func mayHaveApplied(err error) bool { return doclock.MayHaveApplied(uint32(status.Code(err))) }

// write commits one write outside any transaction and returns the
// document's new update time and the commit's server time (zero when the
// reply carries none); applied is false when the write's precondition
// failed (FailedPrecondition: the document changed or is gone; NotFound).
// A create of an existing document returns an error wrapping
// doclock.ErrExists and the service's error. lost is the error of the
// latest attempt that failed in a way that leaves open whether the server
// applied it: then the write may have applied even when err is set or
// applied is false (a retry finds its own write).
func (b *Backend) write(ctx context.Context, w *pb.Write) (version time.Time, applied bool, at time.Time, lost, err error) {
	err = b.retry(ctx, func() error {
		sent := b.now()
		res, err := b.rpc.Commit(b.ctx(ctx), &pb.CommitRequest{Database: b.db, Writes: []*pb.Write{w}})
		switch status.Code(err) {
		case codes.OK:
		case codes.FailedPrecondition, codes.NotFound:
			applied = false
			return nil
		case codes.AlreadyExists:
			return fmt.Errorf("%w: %w", doclock.ErrExists, err)
		default:
			if mayHaveApplied(err) {
				lost = err
			}
			return err
		}
		at = tsTime(res.GetCommitTime())
		b.clock.Observe(at, sent, b.now(), false)
		if len(res.WriteResults) != 1 || !res.WriteResults[0].GetUpdateTime().IsValid() {
			return fmt.Errorf("firestorelock: commit returned %d write results without an update time, want 1", len(res.WriteResults))
		}
		version, applied = res.WriteResults[0].GetUpdateTime().AsTime(), true
		return nil
	})
	return version, applied, at, lost, err
}

// create writes doc if no document of its name exists.
func create(doc *pb.Document) *pb.Write {
	return &pb.Write{
		Operation:       &pb.Write_Update{Update: doc},
		CurrentDocument: &pb.Precondition{ConditionType: &pb.Precondition_Exists{Exists: false}},
	}
}

// update replaces the document with doc if its update time is still
// version.
func update(doc *pb.Document, version time.Time) *pb.Write {
	return &pb.Write{
		Operation:       &pb.Write_Update{Update: doc},
		CurrentDocument: &pb.Precondition{ConditionType: &pb.Precondition_UpdateTime{UpdateTime: timestamppb.New(version)}},
	}
}
