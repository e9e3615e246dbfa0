package datastorelock_test

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
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

func TestContract(t *testing.T) {
	testsvc.Datastore(t)
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		clock := newClock()
		b, f := contractBackend(t, link{}, datastorelock.WithClock(clock.Now))
		return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: clock.Advance, Now: clock.Now, Faults: f,
			WithTTL: withTTL(t, link{}, datastorelock.WithClock(clock.Now)), ServerClock: jumpHarness}
	})
}

// The same suite on the system clock, waiting in real time. The ttl is
// generous: the emulator is a JVM, and on a loaded machine one call can
// take a second.
func TestContractRealClock(t *testing.T) {
	testsvc.Datastore(t)
	const ttl = 5 * time.Second
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		b, f := contractBackend(t, link{}, datastorelock.WithTTL(ttl))
		// The history case runs its 10,000 calls in TestContract and
		// TestContractServerClock/client_ahead; in real time, fewer.
		return storetest.Harness{Backend: b, TTL: ttl, Step: ttl / 10, Faults: f, HistoryOps: 3000, WithTTL: withTTL(t, link{})}
	})
}

// The suite again, with replies that carry the server's time (as the
// production service's do) while the backend's own clock is hours off.
func TestContractServerClock(t *testing.T) {
	testsvc.Datastore(t)
	for _, c := range []struct {
		name       string
		off        time.Duration
		historyOps int // 0: the history case's full 10,000 calls
	}{{"client_ahead", skew, 0}, {"client_behind", -skew, 3000}} {
		t.Run(c.name, func(t *testing.T) {
			storetest.Run(t, func(t *testing.T) storetest.Harness {
				server := newClock()
				b, f := contractBackend(t, link{server: server.Now}, datastorelock.WithClock(skewed(server, c.off)))
				return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: server.Advance, Now: server.Now, Faults: f, HistoryOps: c.historyOps,
					WithTTL: withTTL(t, link{server: server.Now}, datastorelock.WithClock(skewed(server, c.off)))}
			})
		})
	}
}

// The operations (store.Operator) by the rules of storetest.RunOps, on the
// emulator, judged by the backend's own clock (the emulator reports none).
func TestOps(t *testing.T) {
	testsvc.Datastore(t)
	storetest.RunOps(t, func(t *testing.T) storetest.Harness {
		clock := newClock()
		b, f := contractBackend(t, link{}, datastorelock.WithClock(clock.Now))
		return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: clock.Advance, Now: clock.Now, Faults: f}
	})
}

// The operations again, with replies that carry the server's time (as the
// production service's do) while the backend's own clock is hours off:
// Inspect and List report the server's time, and ForceRelease ends the
// lease by it.
func TestOpsServerClock(t *testing.T) {
	testsvc.Datastore(t)
	for _, c := range []struct {
		name string
		off  time.Duration
	}{{"client_ahead", skew}, {"client_behind", -skew}} {
		t.Run(c.name, func(t *testing.T) {
			storetest.RunOps(t, func(t *testing.T) storetest.Harness {
				server := newClock()
				b, f := contractBackend(t, link{server: server.Now}, datastorelock.WithClock(skewed(server, c.off)))
				return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: server.Advance, Now: server.Now, Faults: f}
			})
		})
	}
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

// New builds a working backend on a connection the test dialled, and the
// backend's Close leaves that connection open and usable.
func TestNewOnACallersConnectionLeavesItOpen(t *testing.T) {
	conn := dialEmulator(t, testsvc.Datastore(t))
	ctx := t.Context()
	ns := namespace()
	b, err := datastorelock.New(conn, project, datastorelock.WithNamespace(ns))
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
	again, err := datastorelock.New(conn, project, datastorelock.WithNamespace(ns))
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
	testsvc.Datastore(t) // sets DATASTORE_EMULATOR_HOST
	ctx := t.Context()
	b, err := datastorelock.Dial(ctx, project, datastorelock.WithNamespace(namespace()))
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

// RPCs per delivery, on the emulator (the client's clock) and with replies
// that carry the server's time (the production service).
func TestRPCsPerDelivery(t *testing.T) {
	testsvc.Datastore(t)
	for _, mode := range []string{"client_clock", "server_clock"} {
		t.Run(mode, func(t *testing.T) {
			clock := newClock()
			var l link
			if mode == "server_clock" {
				l.server = clock.Now
			}
			b, r := newBackendVia(t, l, datastorelock.WithClock(clock.Now))
			ctx := t.Context()
			check := func(what string, want int, run func()) {
				t.Helper()
				r.take()
				run()
				if calls := r.take(); len(calls) != want {
					t.Errorf("%s: %d RPCs %v, want %d", what, len(calls), calls, want)
				}
			}
			check("a backend's first delivery (lookup for the clock + insert + versioned update)", 3, func() { idempotency.Lock(ctx, b, "first", noop) })
			check("fresh key (insert + versioned update)", 2, func() { idempotency.Lock(ctx, b, "fresh", noop) })
			check("duplicate (insert refused + lookup)", 2, func() { idempotency.Lock(ctx, b, "fresh", noop) })
			b.Claim(ctx, "crashed", time.Minute)
			check("held by a live lease (insert refused + lookup)", 2, func() { idempotency.Lock(ctx, b, "crashed", noop) })
			clock.Advance(2 * time.Minute)
			if mode == "server_clock" {
				// The server's time is two minutes old: read first.
				check("reclaim after the lease (lookup + update, then update)", 3, func() { idempotency.Lock(ctx, b, "crashed", noop) })
			} else {
				check("reclaim after the lease (insert refused + lookup + update, then update)", 4, func() { idempotency.Lock(ctx, b, "crashed", noop) })
			}
			check("mutex (insert + versioned update)", 2, func() { idempotency.Mutex(ctx, b, "po", noop) })
			check("mutex again (insert refused + lookup + update, then update)", 4, func() { idempotency.Mutex(ctx, b, "po", noop) })
		})
	}
}

// Two processes, each with eight goroutines, race one key: one wins.
func TestTwoProcessesRaceOneKey(t *testing.T) {
	addr := testsvc.Datastore(t)
	won, held := testsvc.RaceProcesses(t, "DATASTORE_EMULATOR_HOST="+addr, "HELPER_NS="+namespace())
	if won != 1 || held != 15 {
		t.Fatalf("won %d, held %d across 16 racers in 2 processes; want 1 and 15", won, held)
	}
}

// withTTL is the suite's Harness.WithTTL: a backend built as
// newBackendVia builds one on link l with opts, and the given ttl (its
// records apart from the case's backend's).
func withTTL(t *testing.T, l link, opts ...datastorelock.Option) func(time.Duration) store.Backend {
	return func(ttl time.Duration) store.Backend {
		b, _ := newBackendVia(t, l, append(opts[:len(opts):len(opts)], datastorelock.WithTTL(ttl))...)
		return b
	}
}
