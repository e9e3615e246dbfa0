package firestorelock

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	pb "cloud.google.com/go/firestore/apiv1/firestorepb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var _ store.Operator = (*Backend)(nil)

// Inspect implements store.Inspector: one BatchGetDocuments read, the
// record judged by the reply's read_time, as Claim judges it. It changes
// nothing, an expired record included.
func (b *Backend) Inspect(ctx context.Context, key string) (store.Record, bool, error) {
	return b.lk.Inspect(ctx, key)
}

// List implements store.Lister with queries on the document name alone
// (the collection, a range of __name__, ordered by __name__), which need
// no composite index and no index on any field: the state is filtered in
// the client.
//
// A call reads at most the page's limit of documents (q.Limit, or
// store.DefaultListLimit) with one query, or two when the listing moves
// from one range of IDs to the next. The documents are read in the order
// of their IDs (see [Name]); under a non-empty prefix, first the keys
// stored verbatim, then those stored as "~" + base64url, which are read from the range of IDs that
// the prefix's whole 3-byte groups encode to. Records of another state,
// and encoded IDs outside the prefix, count against the bound without
// being reported: a page may be short, even empty, while Next is set.
// Next is the last ID read, encoded with the prefix and state; a cursor
// from another query is refused with store.ErrInvalidQuery. Each record is
// reported once, judged by its query's read_time.
func (b *Backend) List(ctx context.Context, q store.ListQuery) (store.Page, error) {
	return b.lk.List(ctx, q)
}

// ForceRelease implements store.ForceReleaser: a read and, when the record
// is Claimed with r's fence and version, a write preconditioned on the
// update time the read saw that does what Release does: the lease ends at
// the read's read_time carried forward, the fence goes up by one, the
// token stays. A failed precondition (the holder extended the lease, say)
// makes it read again. When the write's reply is lost, the read after it
// finds the fence moved on and ForceRelease returns false although it
// released; it returns true only for a write the service reported applied.
func (b *Backend) ForceRelease(ctx context.Context, r store.Record) (bool, error) {
	return b.lk.ForceRelease(ctx, r)
}

// Forget implements store.Forgetter: a read and, when the record is Done
// with r's fence and version, a delete preconditioned on the update time
// the read saw. When the delete's reply is lost, Forget may return false
// although it deleted; it returns true only for a delete the service
// reported applied.
func (b *Backend) Forget(ctx context.Context, r store.Record) (bool, error) {
	return b.lk.Forget(ctx, r)
}

// Delete is a Commit of a delete preconditioned on the update time base:
// FailedPrecondition or NotFound (changed or gone) does not apply.
func (q requests) Delete(ctx context.Context, key string, base int64) (applied bool, lost, err error) {
	b := q.b
	w := &pb.Write{
		Operation:       &pb.Write_Delete{Delete: b.docName(key)},
		CurrentDocument: &pb.Precondition{ConditionType: &pb.Precondition_UpdateTime{UpdateTime: timestamppb.New(unrev(base))}},
	}
	err = b.retry(ctx, func() error {
		sent := b.now()
		res, err := b.rpc.Commit(b.ctx(ctx), &pb.CommitRequest{Database: b.db, Writes: []*pb.Write{w}})
		switch status.Code(err) {
		case codes.OK:
			b.clock.Observe(tsTime(res.GetCommitTime()), sent, b.now(), false)
			applied = true
			return nil
		case codes.FailedPrecondition, codes.NotFound:
			applied = false
			return nil
		}
		if mayHaveApplied(err) {
			lost = err
		}
		return err
	})
	return applied, lost, err
}

// validID reports whether id may be a document ID in a query's bound:
// what Name leaves verbatim, "" aside.
func validID(id string) bool {
	return id != "" && Name(id) == id || strings.HasPrefix(id, "~") && !strings.Contains(id, "/")
}

// KeyOf is the inverse of Name.
func (q requests) KeyOf(id string) (string, bool) { return keyOf(id) }

// EncodesAll reports whether prefix contains "/": Name encodes every key
// that does.
func (q requests) EncodesAll(prefix string) bool { return strings.Contains(prefix, "/") }

// Scan is a RunQuery of the collection's documents whose IDs lie in rng,
// ordered by __name__.
func (q requests) Scan(ctx context.Context, rng doclock.NameRange, limit int) (rows []doclock.Row, done bool, rd doclock.Reading, err error) {
	b := q.b
	nameFilter := func(op pb.StructuredQuery_FieldFilter_Operator, id string) *pb.StructuredQuery_Filter {
		return &pb.StructuredQuery_Filter{FilterType: &pb.StructuredQuery_Filter_FieldFilter{FieldFilter: &pb.StructuredQuery_FieldFilter{
			Field: &pb.StructuredQuery_FieldReference{FieldPath: "__name__"},
			Op:    op,
			Value: &pb.Value{ValueType: &pb.Value_ReferenceValue{ReferenceValue: b.docs + id}},
		}}}
	}
	// Bounds that are no document ID: a lower bound that Name would
	// encode ("." or "..", or reserved as __.*__: no record is named by
	// it, and the least ID above it is itself plus "\x01", as no key
	// holds a NUL; a "/" cannot occur, as List scans verbatim IDs only for
	// prefixes without one), and an upper bound that is no ID (with "/",
	// the successor of a prefix ending in ".", or reserved), left off:
	// List ends the scan at the first ID outside the prefix.
	if rng.From != "" && !validID(rng.From) {
		rng.From += "\x01"
	}
	if !validID(rng.To) {
		rng.To = ""
	}
	var filters []*pb.StructuredQuery_Filter
	switch {
	case rng.After != "":
		filters = append(filters, nameFilter(pb.StructuredQuery_FieldFilter_GREATER_THAN, rng.After))
	case rng.From != "":
		filters = append(filters, nameFilter(pb.StructuredQuery_FieldFilter_GREATER_THAN_OR_EQUAL, rng.From))
	}
	if rng.To != "" {
		filters = append(filters, nameFilter(pb.StructuredQuery_FieldFilter_LESS_THAN, rng.To))
	}
	query := &pb.StructuredQuery{
		From:    []*pb.StructuredQuery_CollectionSelector{{CollectionId: b.collection}},
		OrderBy: []*pb.StructuredQuery_Order{{Field: &pb.StructuredQuery_FieldReference{FieldPath: "__name__"}, Direction: pb.StructuredQuery_ASCENDING}},
		Limit:   wrapperspb.Int32(int32(limit)),
	}
	switch len(filters) {
	case 1:
		query.Where = filters[0]
	case 2:
		query.Where = &pb.StructuredQuery_Filter{FilterType: &pb.StructuredQuery_Filter_CompositeFilter{CompositeFilter: &pb.StructuredQuery_CompositeFilter{
			Op: pb.StructuredQuery_CompositeFilter_AND, Filters: filters,
		}}}
	}
	err = b.retry(ctx, func() error {
		rows = nil
		var readAt, recv time.Time
		sent := b.now()
		cctx, cancel := context.WithCancel(b.ctx(ctx))
		defer cancel()
		stream, err := b.rpc.RunQuery(cctx, &pb.RunQueryRequest{
			Parent:    b.db + "/documents",
			QueryType: &pb.RunQueryRequest_StructuredQuery{StructuredQuery: query},
		})
		if err != nil {
			return err
		}
		for {
			m, err := stream.Recv()
			if err == io.EOF {
				break
			}
			if err != nil {
				return err
			}
			if rt := tsTime(m.GetReadTime()); !rt.IsZero() {
				recv = b.now()
				b.clock.Observe(rt, sent, recv, true)
				if readAt.IsZero() || rt.Before(readAt) {
					readAt = rt
				}
			}
			if d := m.GetDocument(); d != nil {
				id, ok := strings.CutPrefix(d.GetName(), b.docs)
				if !ok || strings.Contains(id, "/") {
					return fmt.Errorf("firestorelock: the query returned the document %s, not one of collection %q", d.GetName(), b.collection)
				}
				r, err := decode(d)
				if err != nil {
					return err
				}
				rows = append(rows, doclock.Row{Name: id, Rec: r})
			}
		}
		if recv.IsZero() {
			recv = b.now()
			b.clock.Observe(time.Time{}, sent, recv, true)
		}
		if rd, err = b.clock.Judge(readAt, recv); err != nil {
			return err
		}
		// The stream ends after the last result: fewer documents than the
		// limit means the range holds no more. (Its done flag does not
		// tell: it is set on the last reply of a query its limit cut.)
		done = len(rows) < limit
		return nil
	})
	return rows, done, rd, err
}
