package firestorelock_test

import (
	"errors"
	"testing"
	"time"

	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// The contract suite with replies that carry a fake server clock the
// suite advances, which the backend's own clock reads too.
func TestContract(t *testing.T) {
	testsvc.Firestore(t)
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		server := newClock()
		b, f := contractBackend(t, link{server: server.Now}, firestorelock.WithClock(server.Now))
		return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: server.Advance, Now: server.Now, Faults: f,
			WithTTL: withTTL(t, link{server: server.Now}, firestorelock.WithClock(server.Now)), ServerClock: jumpHarness}
	})
}

// The suite again, with the server's clock driven while the backend's own
// clock is hours off it.
func TestContractServerClock(t *testing.T) {
	testsvc.Firestore(t)
	for _, c := range []struct {
		name string
		off  time.Duration
	}{{"client_ahead", skew}, {"client_behind", -skew}} {
		t.Run(c.name, func(t *testing.T) {
			storetest.Run(t, func(t *testing.T) storetest.Harness {
				server := newClock()
				b, f := contractBackend(t, link{server: server.Now}, firestorelock.WithClock(skewed(server, c.off)))
				return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: server.Advance, Now: server.Now, Faults: f, HistoryOps: 1000,
					WithTTL: withTTL(t, link{server: server.Now}, firestorelock.WithClock(skewed(server, c.off)))}
			})
		})
	}
}

// The operations (store.Operator) by the rules of storetest.RunOps, on the
// emulator, with the server's time driven by the test.
func TestOps(t *testing.T) {
	testsvc.Firestore(t)
	storetest.RunOps(t, func(t *testing.T) storetest.Harness {
		server := newClock()
		b, f := contractBackend(t, link{server: server.Now}, firestorelock.WithClock(server.Now))
		return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: server.Advance, Now: server.Now, Faults: f}
	})
}

// The operations again with the backend's own clock hours off the
// server's: Inspect and List report the server's time, and ForceRelease
// ends the lease by it.
func TestOpsServerClock(t *testing.T) {
	testsvc.Firestore(t)
	for _, c := range []struct {
		name string
		off  time.Duration
	}{{"client_ahead", skew}, {"client_behind", -skew}} {
		t.Run(c.name, func(t *testing.T) {
			storetest.RunOps(t, func(t *testing.T) storetest.Harness {
				server := newClock()
				b, f := contractBackend(t, link{server: server.Now}, firestorelock.WithClock(skewed(server, c.off)))
				return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: server.Advance, Now: server.Now, Faults: f}
			})
		})
	}
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

// New builds a working backend on a connection the test dialled, and the
// backend's Close leaves that connection open and usable.
func TestNewOnACallersConnectionLeavesItOpen(t *testing.T) {
	conn := dialEmulator(t, testsvc.Firestore(t))
	ctx := t.Context()
	coll := collection()
	b, err := firestorelock.New(conn, project, firestorelock.WithCollection(coll))
	if err != nil {
		t.Fatal(err)
	}
	r, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim: %v %v", r.Outcome, err)
	}
	if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
		t.Fatalf("complete: %v %v", ok, err)
	}
	if err := b.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if s := conn.GetState(); s == connectivity.Shutdown {
		t.Fatalf("the caller's connection is %v after the backend's Close", s)
	}
	again, err := firestorelock.New(conn, project, firestorelock.WithCollection(coll))
	if err != nil {
		t.Fatal(err)
	}
	if r, err := again.Claim(ctx, "k", time.Minute); err != nil || r.Outcome != store.AlreadyDone {
		t.Fatalf("a claim on the same connection after the first backend's Close: %v %v, want already done", r.Outcome, err)
	}
}

// Dial's backend owns the connection it dialled: its Close closes it, and
// a call after that fails at once (Canceled: the connection is closing)
// instead of reaching the service.
func TestDialCloseClosesItsConnection(t *testing.T) {
	testsvc.Firestore(t) // sets FIRESTORE_EMULATOR_HOST
	ctx := t.Context()
	b, err := firestorelock.Dial(ctx, project, firestorelock.WithCollection(collection()))
	if err != nil {
		t.Fatal(err)
	}
	if r, err := b.Claim(ctx, "k", time.Minute); err != nil || r.Outcome != store.Won {
		t.Fatalf("claim: %v %v", r.Outcome, err)
	}
	if err := b.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	_, err = b.Claim(ctx, "k2", time.Minute)
	if status.Code(err) != codes.Canceled || ctx.Err() != nil {
		t.Fatalf("claim after Close: %v, want the closed connection's Canceled", err)
	}
}

// RPCs per delivery, counted by a gRPC interceptor (unary and streaming
// calls), on the server's clock: a delivery to a fresh key is 2 RPCs, a
// create and a preconditioned completion.
func TestRPCsPerDelivery(t *testing.T) {
	testsvc.Firestore(t)
	clock := newClock()
	b, r := onClock(t, clock)
	ctx := t.Context()
	check := func(what string, want int, run func()) {
		t.Helper()
		r.take()
		run()
		if calls := r.take(); len(calls) != want {
			t.Errorf("%s: %d RPCs %v, want %d", what, len(calls), calls, want)
		}
	}
	check("a backend's first delivery (read for the clock + create + preconditioned update)", 3, func() { idempotency.Lock(ctx, b, "first", noop) })
	check("fresh key (create + preconditioned update)", 2, func() { idempotency.Lock(ctx, b, "fresh", noop) })
	check("duplicate (create refused + read)", 2, func() { idempotency.Lock(ctx, b, "fresh", noop) })
	b.Claim(ctx, "crashed", time.Minute)
	check("held by a live lease (create refused + read)", 2, func() { idempotency.Lock(ctx, b, "crashed", noop) })
	clock.Advance(2 * time.Minute)
	// The server's time is two minutes old: read first.
	check("reclaim after the lease (read + update, then update)", 3, func() { idempotency.Lock(ctx, b, "crashed", noop) })
	check("mutex (create + preconditioned update)", 2, func() { idempotency.Mutex(ctx, b, "po", noop) })
	check("mutex again (create refused + read + update, then update)", 4, func() { idempotency.Mutex(ctx, b, "po", noop) })
	c, _ := b.Claim(ctx, "ext", time.Minute)
	check("extend (preconditioned update)", 1, func() { b.Extend(ctx, c.Claim, time.Minute) })
	check("release (preconditioned update)", 1, func() { b.Release(ctx, c.Claim) })
}

// Two processes, each with eight goroutines, race one key: one wins.
func TestTwoProcessesRaceOneKey(t *testing.T) {
	addr := testsvc.Firestore(t)
	won, held := testsvc.RaceProcesses(t, "FIRESTORE_EMULATOR_HOST="+addr, "HELPER_COLLECTION="+collection())
	if won != 1 || held != 15 {
		t.Fatalf("won %d, held %d across 16 racers in 2 processes; want 1 and 15", won, held)
	}
}

// withTTL is the suite's Harness.WithTTL: a backend built as
// newBackendVia builds one on link l with opts, and the given ttl (its
// records apart from the case's backend's).
func withTTL(t *testing.T, l link, opts ...firestorelock.Option) func(time.Duration) store.Backend {
	return func(ttl time.Duration) store.Backend {
		b, _ := newBackendVia(t, l, append(opts[:len(opts):len(opts)], firestorelock.WithTTL(ttl))...)
		return b
	}
}
