package firestorelock_test

import (
	"context"
	"testing"
	"time"

	pb "cloud.google.com/go/firestore/apiv1/firestorepb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// The document-store suite, written once in doclocktest, on the Firestore
// emulator.
func TestDriver(t *testing.T) { doclocktest.Run(t, driver{}) }

// driver is doclocktest's Driver on the Firestore emulator: a space of
// records is a collection.
type driver struct{}

func (driver) Emulator(t testing.TB) { testsvc.Firestore(t) }
func (driver) Space() string         { return collection() }

// StampsTime is true: the Firestore emulator's replies carry its own read
// and commit times (the real time), so a backend on a fake clock needs its
// replies stamped with that clock.
func (driver) StampsTime() bool { return true }

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
func options(c doclocktest.Config) []firestorelock.Option {
	var opts []firestorelock.Option
	if c.Space != "" {
		opts = append(opts, firestorelock.WithCollection(c.Space))
	}
	if c.Clock != nil {
		opts = append(opts, firestorelock.WithClock(c.Clock))
	}
	if c.TTL != 0 {
		opts = append(opts, firestorelock.WithTTL(c.TTL))
	}
	if c.Retries != nil {
		opts = append(opts, firestorelock.WithRetries(*c.Retries))
	}
	return opts
}

// PutRaw writes the documents of recs, 500 a commit (Firestore's limit).
func (driver) PutRaw(t testing.TB, coll string, recs ...doclocktest.Raw) {
	t.Helper()
	rpc := pb.NewFirestoreClient(dialEmulator(t, testsvc.Firestore(t)))
	db := "projects/" + project + "/databases/" + firestorelock.DefaultDatabase
	ts := func(t time.Time) *pb.Value {
		return &pb.Value{ValueType: &pb.Value_TimestampValue{TimestampValue: timestamppb.New(t)}}
	}
	for i := 0; i < len(recs); i += 500 {
		writes := make([]*pb.Write, 0, 500)
		for _, r := range recs[i:min(len(recs), i+500)] {
			writes = append(writes, &pb.Write{Operation: &pb.Write_Update{Update: &pb.Document{
				Name: db + "/documents/" + coll + "/" + firestorelock.Name(r.Key),
				Fields: map[string]*pb.Value{
					"state":        {ValueType: &pb.Value_IntegerValue{IntegerValue: r.State}},
					"fence":        {ValueType: &pb.Value_IntegerValue{IntegerValue: r.Fence}},
					"lease_expiry": ts(r.Lease),
					"expires_at":   ts(r.Exp),
					"token":        {ValueType: &pb.Value_StringValue{StringValue: r.Token}},
				},
			}}})
		}
		if _, err := rpc.Commit(context.Background(), &pb.CommitRequest{Database: db, Writes: writes}); err != nil {
			t.Fatal(err)
		}
	}
}
