package datastorelock_test

import (
	"context"
	"testing"
	"time"

	pb "cloud.google.com/go/datastore/apiv1/datastorepb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// The document-store suite, written once in doclocktest, on the Datastore
// emulator.
func TestDriver(t *testing.T) { doclocktest.Run(t, driver{}) }

// driver is doclocktest's Driver on the Datastore emulator: a space of
// records is a namespace.
type driver struct{}

func (driver) Emulator(t testing.TB) { testsvc.Datastore(t) }
func (driver) Space() string         { return namespace() }

// StampsTime is false: the Datastore emulator's replies carry no read or
// commit time (the production service's do; Config.Server stands in for
// them), so a backend on a fake clock judges by that clock alone.
func (driver) StampsTime() bool { return false }

func (driver) New(t testing.TB, c doclocktest.Config) (doclocktest.Backend, *doclocktest.Calls) {
	t.Helper()
	b, r := newBackendVia(t, link{server: c.Server}, options(c)...)
	return b, r.Calls
}

// Contract builds a backend for the contract suites, reached through a
// DropProxy, with its faults.
func (driver) Contract(t *testing.T, c doclocktest.Config) (doclocktest.Backend, storetest.Faults) {
	return contractBackend(t, link{server: c.Server}, options(c)...)
}

// options are the Options of c.
func options(c doclocktest.Config) []datastorelock.Option {
	var opts []datastorelock.Option
	if c.Space != "" {
		opts = append(opts, datastorelock.WithNamespace(c.Space))
	}
	if c.Clock != nil {
		opts = append(opts, datastorelock.WithClock(c.Clock))
	}
	if c.TTL != 0 {
		opts = append(opts, datastorelock.WithTTL(c.TTL))
	}
	if c.Retries != nil {
		opts = append(opts, datastorelock.WithRetries(*c.Retries))
	}
	return opts
}

// PutRaw upserts the entities of recs, 500 a commit (Datastore's limit).
func (driver) PutRaw(t testing.TB, ns string, recs ...doclocktest.Raw) {
	t.Helper()
	rpc := pb.NewDatastoreClient(dialEmulator(t, testsvc.Datastore(t)))
	ts := func(t time.Time) *pb.Value {
		return &pb.Value{ValueType: &pb.Value_TimestampValue{TimestampValue: timestamppb.New(t)}, ExcludeFromIndexes: true}
	}
	for i := 0; i < len(recs); i += 500 {
		muts := make([]*pb.Mutation, 0, 500)
		for _, r := range recs[i:min(len(recs), i+500)] {
			exp := ts(r.Exp)
			exp.ExcludeFromIndexes = false // the purge queries it
			muts = append(muts, &pb.Mutation{Operation: &pb.Mutation_Upsert{Upsert: &pb.Entity{
				Key: &pb.Key{
					PartitionId: &pb.PartitionId{ProjectId: project, NamespaceId: ns},
					Path:        []*pb.Key_PathElement{{Kind: datastorelock.DefaultKind, IdType: &pb.Key_PathElement_Name{Name: datastorelock.Name(r.Key)}}},
				},
				Properties: map[string]*pb.Value{
					"state":        {ValueType: &pb.Value_IntegerValue{IntegerValue: r.State}, ExcludeFromIndexes: true},
					"fence":        {ValueType: &pb.Value_IntegerValue{IntegerValue: r.Fence}, ExcludeFromIndexes: true},
					"lease_expiry": ts(r.Lease),
					"expires_at":   exp,
					"token":        {ValueType: &pb.Value_StringValue{StringValue: r.Token}, ExcludeFromIndexes: true},
				},
			}}})
		}
		if _, err := rpc.Commit(context.Background(), &pb.CommitRequest{
			ProjectId: project, Mode: pb.CommitRequest_NON_TRANSACTIONAL, Mutations: muts,
		}); err != nil {
			t.Fatal(err)
		}
	}
}
