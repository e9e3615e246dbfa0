package firestorelock

import (
	"context"
	"io"
	"time"

	pb "cloud.google.com/go/firestore/apiv1/firestorepb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"
)

// PurgeExpired implements store.Purger, for databases without a TTL policy
// on expires_at. It queries the collection for records whose expires_at
// has passed by the lower bound of the server's time, in batches of 500,
// and deletes those whose expires_at is not after the query's read_time
// with one Commit per batch (or, when a record changed since, one Commit
// per record), each delete preconditioned on the update time the query
// saw, so a record that was reclaimed after the query read it is left
// alone. (BatchWrite would report each delete apart, but the emulator
// serves it only to admin credentials.) A client clock that runs fast cannot make it delete
// early.
func (b *Backend) PurgeExpired(ctx context.Context, limit int) (int, error) {
	return b.lk.Purge(ctx, limit, purger{b})
}

// purger is the Backend's doclock.PurgeStore: a RunQuery of the collection
// on expires_at, and deletes preconditioned on the update time the query
// saw (deleteAll).
type purger struct{ b *Backend }

func (p purger) Probe(ctx context.Context) error { return p.b.probe(ctx) }

// Expired returns the documents, each with its expires_at; last is a
// batch shorter than limit (the streamed reply says no more).
func (p purger) Expired(ctx context.Context, lo time.Time, limit int) ([]doclock.Expired, time.Time, bool, error) {
	docs, readAt, err := p.b.expiredDocs(ctx, lo, int32(limit))
	found := make([]doclock.Expired, 0, len(docs))
	for _, d := range docs {
		// AsTime, not tsTime: an expires_at of time.Time{} has expired.
		if exp := d.GetFields()[fieldExpiresAt].GetTimestampValue(); exp != nil {
			found = append(found, doclock.Expired{Exp: exp.AsTime(), Ref: d})
		}
	}
	return found, readAt, len(docs) < limit, err
}

// Delete commits the preconditioned deletes of recs (deleteAll).
func (p purger) Delete(ctx context.Context, recs []doclock.Expired) (int, error) {
	writes := make([]*pb.Write, 0, len(recs))
	for _, r := range recs {
		d := r.Ref.(*pb.Document)
		writes = append(writes, &pb.Write{
			Operation:       &pb.Write_Delete{Delete: d.GetName()},
			CurrentDocument: &pb.Precondition{ConditionType: &pb.Precondition_UpdateTime{UpdateTime: d.GetUpdateTime()}},
		})
	}
	return p.b.deleteAll(ctx, writes)
}

// expiredDocs queries at most limit documents of the collection whose
// expires_at is not after lo, and returns them with the query's read_time
// (zero when the reply carries none).
func (b *Backend) expiredDocs(ctx context.Context, lo time.Time, limit int32) (docs []*pb.Document, readAt time.Time, err error) {
	err = b.retry(ctx, func() error {
		docs, readAt = nil, time.Time{}
		sent := b.now()
		cctx, cancel := context.WithCancel(b.ctx(ctx))
		defer cancel()
		stream, err := b.rpc.RunQuery(cctx, &pb.RunQueryRequest{
			Parent: b.db + "/documents",
			QueryType: &pb.RunQueryRequest_StructuredQuery{StructuredQuery: &pb.StructuredQuery{
				From: []*pb.StructuredQuery_CollectionSelector{{CollectionId: b.collection}},
				Where: &pb.StructuredQuery_Filter{FilterType: &pb.StructuredQuery_Filter_FieldFilter{FieldFilter: &pb.StructuredQuery_FieldFilter{
					Field: &pb.StructuredQuery_FieldReference{FieldPath: fieldExpiresAt},
					Op:    pb.StructuredQuery_FieldFilter_LESS_THAN_OR_EQUAL,
					Value: &pb.Value{ValueType: &pb.Value_TimestampValue{TimestampValue: timestamppb.New(lo)}},
				}}},
				Limit: wrapperspb.Int32(limit),
			}},
		})
		if err != nil {
			return err
		}
		for {
			m, err := stream.Recv()
			if err == io.EOF {
				return nil
			}
			if err != nil {
				return err
			}
			if rt := tsTime(m.GetReadTime()); !rt.IsZero() {
				b.clock.Observe(rt, sent, b.now(), true)
				if readAt.IsZero() || rt.Before(readAt) {
					readAt = rt
				}
			}
			if d := m.GetDocument(); d != nil {
				docs = append(docs, d)
			}
		}
	})
	return docs, readAt, err
}

// deleteAll commits the preconditioned deletes writes together, or, when
// one of the preconditions fails (the record changed since the query),
// each on its own, and returns how many applied. After a lost reply the
// count may miss deletes that applied.
func (b *Backend) deleteAll(ctx context.Context, writes []*pb.Write) (int, error) {
	commit := func(ws []*pb.Write) (bool, error) {
		applied := false
		err := b.retry(ctx, func() error {
			sent := b.now()
			res, err := b.rpc.Commit(b.ctx(ctx), &pb.CommitRequest{Database: b.db, Writes: ws})
			switch status.Code(err) {
			case codes.OK:
				b.clock.Observe(tsTime(res.GetCommitTime()), sent, b.now(), false)
				applied = true
				return nil
			case codes.FailedPrecondition, codes.NotFound:
				applied = false
				return nil
			}
			return err
		})
		return applied, err
	}
	ok, err := commit(writes)
	if err != nil {
		return 0, err
	}
	if ok {
		return len(writes), nil
	}
	if len(writes) == 1 {
		return 0, nil
	}
	deleted := 0
	for _, w := range writes {
		ok, err := commit([]*pb.Write{w})
		if err != nil {
			return deleted, err
		}
		if ok {
			deleted++
		}
	}
	return deleted, nil
}
