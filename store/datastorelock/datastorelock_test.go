package datastorelock_test

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
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
)

// storetest's suites (the contract and the operations) on the Datastore
// emulator, through doclocktest. The server-clock history runs its full
// 10,000 calls with the client ahead and 3,000 with it behind, and the
// contract runs again in real time.
func TestContract(t *testing.T) {
	doclocktest.RunContract(t, driver{}, doclocktest.Tuning{ServerClockHistoryOps: [2]int{0, 3000}, RealClock: true})
}

// New takes the connection and project as given: it refuses a nil
// connection, an empty project (it reads none from the environment), an
// invalid option, and WithClientOptions (it does not dial).
func TestNewRefusesBadConfiguration(t *testing.T) {
	t.Setenv("DATASTORE_PROJECT_ID", "from-env")
	t.Setenv("GOOGLE_CLOUD_PROJECT", "from-env")
	conn := dialEmulator(t, "127.0.0.1:1") // never used: nothing is sent
	for name, c := range map[string]struct {
		conn    grpc.ClientConnInterface
		project string
		opts    []datastorelock.Option
		want    error
	}{
		"nil conn":             {conn: nil, project: "p", want: datastorelock.ErrNilConn},
		"typed nil conn":       {conn: (*grpc.ClientConn)(nil), project: "p", want: datastorelock.ErrNilConn},
		"empty project":        {conn: conn, project: "", want: datastorelock.ErrNoProject},
		"client options":       {conn: conn, project: "p", opts: []datastorelock.Option{datastorelock.WithClientOptions(option.WithoutAuthentication())}, want: datastorelock.ErrClientOptions},
		"empty client options": {conn: conn, project: "p", opts: []datastorelock.Option{datastorelock.WithClientOptions()}, want: datastorelock.ErrClientOptions},
		"ttl -1":               {conn: conn, project: "p", opts: []datastorelock.Option{datastorelock.WithTTL(-1)}, want: store.ErrInvalidTTL},
		"reserved kind":        {conn: conn, project: "p", opts: []datastorelock.Option{datastorelock.WithKind("__reserved__")}},
		"empty kind":           {conn: conn, project: "p", opts: []datastorelock.Option{datastorelock.WithKind("")}},
		"negative retries":     {conn: conn, project: "p", opts: []datastorelock.Option{datastorelock.WithRetries(-1)}},
	} {
		b, err := datastorelock.New(c.conn, c.project, c.opts...)
		switch {
		case err == nil:
			t.Errorf("%s: New accepted it: %v", name, b)
		case c.want != nil && !errors.Is(err, c.want):
			t.Errorf("%s: %v, want an error wrapping %v", name, err, c.want)
		}
	}
	if _, err := datastorelock.New(conn, "p", datastorelock.WithRetries(0), datastorelock.WithTTL(time.Minute)); err != nil {
		t.Fatalf("a valid configuration: %v", err)
	}
}

// Dial keeps the one-liner's defaults: the project from
// DATASTORE_PROJECT_ID, then GOOGLE_CLOUD_PROJECT; and refuses what New
// refuses.
func TestDialReadsTheProjectFromTheEnvironment(t *testing.T) {
	t.Setenv("DATASTORE_PROJECT_ID", "")
	t.Setenv("GOOGLE_CLOUD_PROJECT", "")
	t.Setenv("DATASTORE_EMULATOR_HOST", "127.0.0.1:1")
	ctx := t.Context()
	if _, err := datastorelock.Dial(ctx, ""); !errors.Is(err, datastorelock.ErrNoProject) {
		t.Errorf("no project: %v, want an error wrapping %v", err, datastorelock.ErrNoProject)
	}
	if _, err := datastorelock.Dial(ctx, "p", datastorelock.WithTTL(-1)); !errors.Is(err, store.ErrInvalidTTL) {
		t.Errorf("ttl -1: %v", err)
	}
	if _, err := datastorelock.Dial(ctx, "p", datastorelock.WithKind("__reserved__")); err == nil {
		t.Error("reserved kind accepted")
	}
	for _, env := range []string{"GOOGLE_CLOUD_PROJECT", "DATASTORE_PROJECT_ID"} {
		t.Setenv(env, "from-"+env)
		b, err := datastorelock.Dial(ctx, "")
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
	conn := dialEmulator(t, testsvc.Datastore(t))
	newOn := func(space string) (doclocktest.Backend, io.Closer, error) {
		b, err := datastorelock.New(conn, project, datastorelock.WithNamespace(space))
		return b, b, err
	}
	return newOn, func() bool { return conn.GetState() == connectivity.Shutdown }
}

func (driver) Dial(t *testing.T, space string) (doclocktest.Backend, io.Closer, error) {
	b, err := datastorelock.Dial(t.Context(), project, datastorelock.WithNamespace(space))
	if err != nil {
		return nil, nil, err
	}
	return b, b, nil
}

// Two processes, each with eight goroutines, race one key: one wins.
func TestTwoProcessesRaceOneKey(t *testing.T) {
	addr := testsvc.Datastore(t)
	won, held := testsvc.RaceProcesses(t, "DATASTORE_EMULATOR_HOST="+addr, "HELPER_NS="+namespace())
	if won != 1 || held != 15 {
		t.Fatalf("won %d, held %d across 16 racers in 2 processes; want 1 and 15", won, held)
	}
}
