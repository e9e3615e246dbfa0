package datastorelock

import (
	"context"
	"time"

	pb "cloud.google.com/go/datastore/apiv1/datastorepb"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"
)

// PurgeExpired implements store.Purger, for databases without a TTL policy
// on expires_at. It queries records whose expires_at has passed by the
// lower bound of the server's time, in batches of 500 (whole entities: a
// projection would not carry their versions), and deletes those whose
// expires_at is not after the query's read_time, each with a versioned
// delete, so a record that was reclaimed after the query read it is left
// alone. A client clock that runs fast cannot make it delete early.
func (b *Backend) PurgeExpired(ctx context.Context, limit int) (int, error) {
	return b.lk.Purge(ctx, limit, purger{b})
}

// purger is the Backend's doclock.PurgeStore: a RunQuery of the kind on
// expires_at (whole entities: a projection would not carry their
// versions), and one Commit of the deletes, each with base_version.
type purger struct{ b *Backend }

func (p purger) Probe(ctx context.Context) error { return p.b.probe(ctx) }

// Expired returns the entity results, each with its expires_at; last is
// the batch's more_results saying there are none.
func (p purger) Expired(ctx context.Context, lo time.Time, limit int) (found []doclock.Expired, readAt time.Time, last bool, err error) {
	b := p.b
	err = b.retry(ctx, func() error {
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
				Limit: wrapperspb.Int32(int32(limit)),
			}},
		})
		if err != nil {
			return err
		}
		readAt = tsTime(res.GetBatch().GetReadTime())
		b.clock.Observe(readAt, sent, b.now(), true)
		found = found[:0]
		for _, r := range res.GetBatch().GetEntityResults() {
			// AsTime, not tsTime: an expires_at of time.Time{} has expired.
			if exp := r.GetEntity().GetProperties()[propExpiresAt].GetTimestampValue(); exp != nil {
				found = append(found, doclock.Expired{Exp: exp.AsTime(), Ref: r})
			}
		}
		last = res.GetBatch().GetMoreResults() == pb.QueryResultBatch_NO_MORE_RESULTS
		return nil
	})
	return found, readAt, last, err
}

// Delete commits the deletes of recs together, each with the base_version
// the query saw: a conflicting one does not apply, the others do.
func (p purger) Delete(ctx context.Context, recs []doclock.Expired) (int, error) {
	b := p.b
	muts := make([]*pb.Mutation, 0, len(recs))
	for _, r := range recs {
		e := r.Ref.(*pb.EntityResult)
		muts = append(muts, &pb.Mutation{
			Operation:                 &pb.Mutation_Delete{Delete: e.GetEntity().GetKey()},
			ConflictDetectionStrategy: &pb.Mutation_BaseVersion{BaseVersion: e.GetVersion()},
		})
	}
	var deleted int
	err := b.retry(ctx, func() error {
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
	return deleted, err
}
