package firestorelock_test

import (
	"errors"
	"io"
	"testing"
	"time"

	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
)

// storetest's suites (the contract and the operations) on the Firestore
// emulator, through doclocktest. The Firestore emulator is slower than the
// Datastore one: the server-clock history runs 1,000 calls each way, and
// the real-time contract is left to Datastore, as before this suite was
// shared.
func TestContract(t *testing.T) {
	doclocktest.RunContract(t, driver{}, doclocktest.Tuning{ServerClockHistoryOps: [2]int{1000, 1000}})
}

// New takes the connection and project as given: it refuses a nil
// connection, an empty project (it reads none from the environment), an
// invalid option, and WithClientOptions (it does not dial).
func TestNewRefusesBadConfiguration(t *testing.T) {
	t.Setenv("GOOGLE_CLOUD_PROJECT", "from-env")
	conn := dialEmulator(t, "127.0.0.1:1") // never used: nothing is sent
	for name, c := range map[string]struct {
		conn    grpc.ClientConnInterface
		project string
		opts    []firestorelock.Option
		want    error
	}{
		"nil conn":             {conn: nil, project: "p", want: firestorelock.ErrNilConn},
		"typed nil conn":       {conn: (*grpc.ClientConn)(nil), project: "p", want: firestorelock.ErrNilConn},
		"empty project":        {conn: conn, project: "", want: firestorelock.ErrNoProject},
		"client options":       {conn: conn, project: "p", opts: []firestorelock.Option{firestorelock.WithClientOptions(option.WithoutAuthentication())}, want: firestorelock.ErrClientOptions},
		"empty client options": {conn: conn, project: "p", opts: []firestorelock.Option{firestorelock.WithClientOptions()}, want: firestorelock.ErrClientOptions},
		"ttl -1":               {conn: conn, project: "p", opts: []firestorelock.Option{firestorelock.WithTTL(-1)}, want: store.ErrInvalidTTL},
		"reserved collection":  {conn: conn, project: "p", opts: []firestorelock.Option{firestorelock.WithCollection("__reserved__")}},
		"empty collection":     {conn: conn, project: "p", opts: []firestorelock.Option{firestorelock.WithCollection("")}},
		"collection path":      {conn: conn, project: "p", opts: []firestorelock.Option{firestorelock.WithCollection("a/b/c")}},
		"empty database":       {conn: conn, project: "p", opts: []firestorelock.Option{firestorelock.WithDatabase("")}},
		"negative retries":     {conn: conn, project: "p", opts: []firestorelock.Option{firestorelock.WithRetries(-1)}},
	} {
		b, err := firestorelock.New(c.conn, c.project, c.opts...)
		switch {
		case err == nil:
			t.Errorf("%s: New accepted it: %v", name, b)
		case c.want != nil && !errors.Is(err, c.want):
			t.Errorf("%s: %v, want an error wrapping %v", name, err, c.want)
		}
	}
	if _, err := firestorelock.New(conn, "p", firestorelock.WithRetries(0), firestorelock.WithTTL(time.Minute),
		firestorelock.WithDatabase("other"), firestorelock.WithCollection("keys")); err != nil {
		t.Fatalf("a valid configuration: %v", err)
	}
}

// Dial keeps the one-liner's defaults: the project from
// GOOGLE_CLOUD_PROJECT, then GCLOUD_PROJECT; and refuses what New refuses.
func TestDialReadsTheProjectFromTheEnvironment(t *testing.T) {
	t.Setenv("GOOGLE_CLOUD_PROJECT", "")
	t.Setenv("GCLOUD_PROJECT", "")
	t.Setenv("FIRESTORE_EMULATOR_HOST", "127.0.0.1:1")
	ctx := t.Context()
	if _, err := firestorelock.Dial(ctx, ""); !errors.Is(err, firestorelock.ErrNoProject) {
		t.Errorf("no project: %v, want an error wrapping %v", err, firestorelock.ErrNoProject)
	}
	if _, err := firestorelock.Dial(ctx, "p", firestorelock.WithTTL(-1)); !errors.Is(err, store.ErrInvalidTTL) {
		t.Errorf("ttl -1: %v", err)
	}
	if _, err := firestorelock.Dial(ctx, "p", firestorelock.WithCollection("__reserved__")); err == nil {
		t.Error("reserved collection accepted")
	}
	for _, env := range []string{"GCLOUD_PROJECT", "GOOGLE_CLOUD_PROJECT"} {
		t.Setenv(env, "from-"+env)
		b, err := firestorelock.Dial(ctx, "")
		if err != nil {
			t.Fatalf("project from %s: %v", env, err)
		}
		if err := b.Close(); err != nil {
			t.Fatalf("close: %v", err)
		}
	}
}

// The constructors' cases (doclocktest.RunConns): New on a caller's
// connection, and Dial's Close.
func TestConns(t *testing.T) { doclocktest.RunConns(t, driver{}, driver{}) }

func (driver) OnConn(t *testing.T) (func(string) (doclocktest.Backend, io.Closer, error), func() bool) {
	conn := dialEmulator(t, testsvc.Firestore(t))
	newOn := func(space string) (doclocktest.Backend, io.Closer, error) {
		b, err := firestorelock.New(conn, project, firestorelock.WithCollection(space))
		return b, b, err
	}
	return newOn, func() bool { return conn.GetState() == connectivity.Shutdown }
}

func (driver) Dial(t *testing.T, space string) (doclocktest.Backend, io.Closer, error) {
	b, err := firestorelock.Dial(t.Context(), project, firestorelock.WithCollection(space))
	if err != nil {
		return nil, nil, err
	}
	return b, b, nil
}

// Two processes, each with eight goroutines, race one key: one wins.
func TestTwoProcessesRaceOneKey(t *testing.T) {
	addr := testsvc.Firestore(t)
	won, held := testsvc.RaceProcesses(t, "FIRESTORE_EMULATOR_HOST="+addr, "HELPER_COLLECTION="+collection())
	if won != 1 || held != 15 {
		t.Fatalf("won %d, held %d across 16 racers in 2 processes; want 1 and 15", won, held)
	}
}
