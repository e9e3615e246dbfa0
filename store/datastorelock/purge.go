package datastorelock

import (
	"context"
	"fmt"
	"time"

	pb "cloud.google.com/go/datastore/apiv1/datastorepb"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"
)

// purgeBatch is how many records one PurgeExpired round reads and deletes.
const purgeBatch = 500

// PurgeExpired implements store.Purger, for databases without a TTL policy
// on expires_at. It queries records whose expires_at has passed by the
// lower bound of the server's time, in batches of 500 (whole entities: a
// projection would not carry their versions), and deletes those whose
// expires_at is not after the query's read_time, each with a versioned
// delete, so a record that was reclaimed after the query read it is left
// alone. A client clock that runs fast cannot make it delete early.
func (b *Backend) PurgeExpired(ctx context.Context, limit int) (int, error) {
	total := 0
	for limit <= 0 || total < limit {
		lo, _, ok := b.clock.Times()
		if !ok {
			if err := b.probe(ctx); err != nil {
				return total, fmt.Errorf("datastorelock: purge: reading the server's time: %w", err)
			}
			if lo, _, ok = b.clock.Times(); !ok {
				return total, fmt.Errorf("datastorelock: purge: %w", doclock.ErrNoServerTime)
			}
		}
		batch := int32(purgeBatch)
		if limit > 0 && limit-total < purgeBatch {
			batch = int32(limit - total)
		}
		var (
			found  []*pb.EntityResult
			last   bool // the query has no results past this batch
			readAt time.Time
		)
		err := b.retry(ctx, func() error {
			sent := b.now()
			res, err := b.rpc.RunQuery(b.ctx(ctx), &pb.RunQueryRequest{
				ProjectId:   b.project,
				DatabaseId:  b.database,
				PartitionId: &pb.PartitionId{ProjectId: b.project, DatabaseId: b.database, NamespaceId: b.namespace},
				QueryType: &pb.RunQueryRequest_Query{Query: &pb.Query{
					Kind: []*pb.KindExpression{{Name: b.kind}},
					Filter: &pb.Filter{FilterType: &pb.Filter_PropertyFilter{PropertyFilter: &pb.PropertyFilter{
						Property: &pb.PropertyReference{Name: propExpiresAt},
						Op:       pb.PropertyFilter_LESS_THAN_OR_EQUAL,
						Value:    &pb.Value{ValueType: &pb.Value_TimestampValue{TimestampValue: timestamppb.New(lo)}},
					}}},
					Limit: wrapperspb.Int32(batch),
				}},
			})
			if err != nil {
				return err
			}
			readAt = tsTime(res.GetBatch().GetReadTime())
			b.clock.Observe(readAt, sent, b.now(), true)
			found = res.GetBatch().GetEntityResults()
			last = res.GetBatch().GetMoreResults() == pb.QueryResultBatch_NO_MORE_RESULTS
			return nil
		})
		if err != nil {
			return total, fmt.Errorf("datastorelock: purge query: %w", err)
		}
		muts := make([]*pb.Mutation, 0, len(found))
		for _, r := range found {
			exp := r.GetEntity().GetProperties()[propExpiresAt].GetTimestampValue()
			if exp == nil || exp.AsTime().After(lo) || (!readAt.IsZero() && exp.AsTime().After(readAt)) {
				continue // not expired by the server's reckoning
			}
			muts = append(muts, &pb.Mutation{
				Operation:                 &pb.Mutation_Delete{Delete: r.GetEntity().GetKey()},
				ConflictDetectionStrategy: &pb.Mutation_BaseVersion{BaseVersion: r.GetVersion()},
			})
		}
		if len(muts) == 0 {
			return total, nil
		}
		var deleted int
		err = b.retry(ctx, func() error {
			sent := b.now()
			res, err := b.rpc.Commit(b.ctx(ctx), &pb.CommitRequest{
				ProjectId: b.project, DatabaseId: b.database,
				Mode: pb.CommitRequest_NON_TRANSACTIONAL, Mutations: muts,
			})
			if err != nil {
				return err
			}
			b.clock.Observe(tsTime(commitTime(res)), sent, b.now(), false)
			deleted = 0
			for _, mr := range res.MutationResults {
				if !mr.ConflictDetected {
					deleted++
				}
			}
			return nil
		})
		if err != nil {
			return total, fmt.Errorf("datastorelock: purge delete: %w", err)
		}
		total += deleted
		// The service may return fewer results than the limit with more
		// to come (the emulator stops at 300): only a batch that says it
		// is the last, or that deleted nothing, ends the purge.
		if last || deleted == 0 {
			return total, nil
		}
	}
	return total, nil
}
