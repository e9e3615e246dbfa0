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
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"
)

// purgeBatch is how many records one PurgeExpired round reads and deletes.
const purgeBatch = 500

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
	total := 0
	for limit <= 0 || total < limit {
		lo, _, ok := b.clock.Times()
		if !ok {
			if err := b.probe(ctx); err != nil {
				return total, fmt.Errorf("firestorelock: purge: reading the server's time: %w", err)
			}
			if lo, _, ok = b.clock.Times(); !ok {
				return total, fmt.Errorf("firestorelock: purge: %w", doclock.ErrNoServerTime)
			}
		}
		batch := int32(purgeBatch)
		if limit > 0 && limit-total < purgeBatch {
			batch = int32(limit - total)
		}
		found, readAt, err := b.expiredDocs(ctx, lo, batch)
		if err != nil {
			return total, fmt.Errorf("firestorelock: purge query: %w", err)
		}
		writes := make([]*pb.Write, 0, len(found))
		for _, d := range found {
			exp := d.GetFields()[fieldExpiresAt].GetTimestampValue()
			if exp == nil || exp.AsTime().After(lo) || (!readAt.IsZero() && exp.AsTime().After(readAt)) {
				continue // not expired by the server's reckoning
			}
			writes = append(writes, &pb.Write{
				Operation:       &pb.Write_Delete{Delete: d.GetName()},
				CurrentDocument: &pb.Precondition{ConditionType: &pb.Precondition_UpdateTime{UpdateTime: d.GetUpdateTime()}},
			})
		}
		if len(writes) == 0 {
			return total, nil
		}
		deleted, err := b.deleteAll(ctx, writes)
		if err != nil {
			return total, fmt.Errorf("firestorelock: purge delete: %w", err)
		}
		total += deleted
		if len(found) < int(batch) || deleted == 0 {
			return total, nil
		}
	}
	return total, nil
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
