package datastorelock

import (
	"context"
	"fmt"

	pb "cloud.google.com/go/datastore/apiv1/datastorepb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var _ store.Operator = (*Backend)(nil)

// Inspect implements store.Inspector: one Lookup, the record judged by
// the reply's read_time (by the estimate of the server's time when it
// carries none, or by the client's clock on the emulator, as Claim judges
// it). It changes nothing, an expired record included.
func (b *Backend) Inspect(ctx context.Context, key string) (store.Record, bool, error) {
	return b.lk.Inspect(ctx, key)
}

// List implements store.Lister with queries on the entity key alone
// (kind, key range, ordered by key), which need no composite index: the
// state property is not indexed, so the state is filtered in the client.
//
// A call reads at most the page's limit of entities (q.Limit, or
// store.DefaultListLimit) with one query, or a few when the emulator
// returns a batch in parts or the listing moves from one range of names
// to the next. The entities are read in the order of their names (see
// [Name]); under a non-empty prefix, first the keys stored verbatim, then
// those stored as "~" + base64url, which are read from the range of names that the prefix's
// whole 3-byte groups encode to. Records of another state, and encoded
// names outside the prefix, count against the bound without being
// reported: a page may be short, even empty, while Next is set. Next is
// the last name read, encoded with the prefix and state; a cursor from
// another query is refused with store.ErrInvalidQuery. Each record is
// reported once, judged by its query's read_time.
func (b *Backend) List(ctx context.Context, q store.ListQuery) (store.Page, error) {
	return b.lk.List(ctx, q)
}

// ForceRelease implements store.ForceReleaser: a Lookup and, when the
// record is Claimed with r's fence and version, an update conditioned on
// the version the Lookup saw (base_version) that does what Release does:
// the lease ends at the Lookup's time carried forward, the fence goes up
// by one, the token stays. A conflict (the holder extended the lease, say)
// makes it look again. When the update's reply is lost, the Lookup after
// it finds the fence moved on and ForceRelease returns false although it
// released; it returns true only for an update the service reported
// applied.
func (b *Backend) ForceRelease(ctx context.Context, r store.Record) (bool, error) {
	return b.lk.ForceRelease(ctx, r)
}

// Forget implements store.Forgetter: a Lookup and, when the record is
// Done with r's fence and version, a delete conditioned on the version
// the Lookup saw (base_version). When the delete's reply is lost, Forget
// may return false although it deleted; it returns true only for a delete
// the service reported applied.
func (b *Backend) Forget(ctx context.Context, r store.Record) (bool, error) {
	return b.lk.Forget(ctx, r)
}

// Delete is a Commit of a delete with base_version base.
func (q requests) Delete(ctx context.Context, key string, base int64) (bool, error, error) {
	m := &pb.Mutation{
		Operation:                 &pb.Mutation_Delete{Delete: q.b.dsKey(key)},
		ConflictDetectionStrategy: &pb.Mutation_BaseVersion{BaseVersion: base},
	}
	_, applied, _, lost, err := q.b.write(ctx, m)
	if status.Code(err) == codes.NotFound {
		return false, lost, nil
	}
	return applied, lost, err
}

// KeyOf is the inverse of Name.
func (q requests) KeyOf(name string) (string, bool) { return keyOf(name) }

// EncodesAll is false: Name encodes no prefix's keys all but those that
// start with "~".
func (q requests) EncodesAll(string) bool { return false }

// nameKey is the key of the entity named name.
func (b *Backend) nameKey(name string) *pb.Value {
	k := b.dsKey("")
	k.Path[0].IdType = &pb.Key_PathElement_Name{Name: name}
	return &pb.Value{ValueType: &pb.Value_KeyValue{KeyValue: k}}
}

// Scan is a RunQuery of the kind's entities whose names lie in rng,
// ordered by key.
func (q requests) Scan(ctx context.Context, rng doclock.NameRange, limit int) (rows []doclock.Row, done bool, rd doclock.Reading, err error) {
	b := q.b
	keyFilter := func(op pb.PropertyFilter_Operator, name string) *pb.Filter {
		return &pb.Filter{FilterType: &pb.Filter_PropertyFilter{PropertyFilter: &pb.PropertyFilter{
			Property: &pb.PropertyReference{Name: "__key__"}, Op: op, Value: b.nameKey(name),
		}}}
	}
	var filters []*pb.Filter
	switch {
	case rng.After != "":
		filters = append(filters, keyFilter(pb.PropertyFilter_GREATER_THAN, rng.After))
	case rng.From != "":
		filters = append(filters, keyFilter(pb.PropertyFilter_GREATER_THAN_OR_EQUAL, rng.From))
	}
	if rng.To != "" {
		filters = append(filters, keyFilter(pb.PropertyFilter_LESS_THAN, rng.To))
	}
	query := &pb.Query{
		Kind:  []*pb.KindExpression{{Name: b.kind}},
		Order: []*pb.PropertyOrder{{Property: &pb.PropertyReference{Name: "__key__"}, Direction: pb.PropertyOrder_ASCENDING}},
		Limit: wrapperspb.Int32(int32(limit)),
	}
	switch len(filters) {
	case 1:
		query.Filter = filters[0]
	case 2:
		query.Filter = &pb.Filter{FilterType: &pb.Filter_CompositeFilter{CompositeFilter: &pb.CompositeFilter{
			Op: pb.CompositeFilter_AND, Filters: filters,
		}}}
	}
	err = b.retry(ctx, func() error {
		rows = nil
		sent := b.now()
		res, err := b.rpc.RunQuery(b.ctx(ctx), &pb.RunQueryRequest{
			ProjectId:   b.project,
			DatabaseId:  b.database,
			PartitionId: &pb.PartitionId{ProjectId: b.project, DatabaseId: b.database, NamespaceId: b.namespace},
			QueryType:   &pb.RunQueryRequest_Query{Query: query},
		})
		if err != nil {
			return err
		}
		recv := b.now()
		batch := res.GetBatch()
		b.clock.Observe(tsTime(batch.GetReadTime()), sent, recv, true)
		if rd, err = b.clock.Judge(tsTime(batch.GetReadTime()), recv); err != nil {
			return err
		}
		for _, er := range batch.GetEntityResults() {
			path := er.GetEntity().GetKey().GetPath()
			if len(path) != 1 {
				return fmt.Errorf("datastorelock: the query returned the entity %v, not a root entity of kind %q", er.GetEntity().GetKey(), b.kind)
			}
			r, err := decode(er)
			if err != nil {
				return err
			}
			rows = append(rows, doclock.Row{Name: path[0].GetName(), Rec: r})
		}
		// A batch that stops short of the limit without NOT_FINISHED
		// is the last: the emulator reports MORE_RESULTS_AFTER_LIMIT for
		// every query with a limit, and NOT_FINISHED when it stops a
		// batch at 300 entities.
		more := batch.GetMoreResults()
		done = more == pb.QueryResultBatch_NO_MORE_RESULTS || (more != pb.QueryResultBatch_NOT_FINISHED && len(rows) < limit)
		return nil
	})
	return rows, done, rd, err
}
