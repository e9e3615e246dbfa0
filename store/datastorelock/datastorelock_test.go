package datastorelock_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "cloud.google.com/go/datastore/apiv1/datastorepb"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

const project = "idempotency-test"

func TestMain(m *testing.M) {
	if testsvc.IsRaceChild() {
		os.Exit(raceChild())
	}
	code := m.Run()
	testsvc.StopAll()
	os.Exit(code)
}

func namespace() string { return fmt.Sprintf("t%016x", rand.Uint64()) }

// rpcs counts the RPCs a backend sends and can lose a reply after the
// server applied the request.
type rpcs struct {
	mu    sync.Mutex
	calls []string
	// loseNext loses the reply of the next RPC, whatever its method.
	loseNext atomic.Bool
	// loseNextCommit loses the reply of the next Commit.
	loseNextCommit atomic.Bool
	// dropNextCommit fails the next Commit without sending it.
	dropNextCommit atomic.Bool
	lost           atomic.Int32
	// whileLost, when set, runs after a reply was lost or a request
	// dropped, before the backend hears of it.
	whileLost func()
}

func (r *rpcs) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	name := method[strings.LastIndexByte(method, '/')+1:]
	r.mu.Lock()
	r.calls = append(r.calls, name)
	r.mu.Unlock()
	if name == "Commit" && r.dropNextCommit.CompareAndSwap(true, false) {
		r.lost.Add(1)
		if r.whileLost != nil {
			r.whileLost()
		}
		return status.Error(codes.Unavailable, "injected: the commit was lost before it reached the server")
	}
	err := invoker(ctx, method, req, reply, cc, opts...)
	if err == nil && (r.loseNext.CompareAndSwap(true, false) || name == "Commit" && r.loseNextCommit.CompareAndSwap(true, false)) {
		r.lost.Add(1)
		if r.whileLost != nil {
			r.whileLost()
		}
		return status.Error(codes.Unavailable, "injected: the request applied but its reply was lost")
	}
	return err
}

func (r *rpcs) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.calls
	r.calls = nil
	return c
}

// serverTime stands in for the production service's clock, which the
// emulator does not report: it fills read_time into Lookup and RunQuery
// replies and commit_time into Commit replies from a clock of its own, read
// as the request leaves (a server that stamps a request as it arrives,
// with no network latency in between).
type serverTime func() time.Time

func (now serverTime) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	ts := timestamppb.New(now())
	if err := invoker(ctx, method, req, reply, cc, opts...); err != nil {
		return err
	}
	switch r := reply.(type) {
	case *pb.LookupResponse:
		r.ReadTime = ts
	case *pb.RunQueryResponse:
		if r.Batch != nil {
			r.Batch.ReadTime = ts
		}
	case *pb.CommitResponse:
		r.CommitTime = ts
	}
	return nil
}

// link says how a test backend reaches the emulator.
type link struct {
	// server, when set, is the service's clock its replies report.
	server func() time.Time
	// proxy, when set, carries its connections.
	proxy *testsvc.DropProxy
}

func newBackend(t testing.TB, opts ...datastorelock.Option) (*datastorelock.Backend, *rpcs) {
	t.Helper()
	return newBackendVia(t, link{}, opts...)
}

func newBackendVia(t testing.TB, l link, opts ...datastorelock.Option) (*datastorelock.Backend, *rpcs) {
	t.Helper()
	r := &rpcs{}
	chain := []grpc.UnaryClientInterceptor{r.intercept}
	if l.server != nil {
		chain = append(chain, serverTime(l.server).intercept)
	}
	client := []option.ClientOption{option.WithGRPCDialOption(grpc.WithChainUnaryInterceptor(chain...))}
	if l.proxy != nil {
		// Reconnect soon after a cut: gRPC's default backoff after a failed
		// connection attempt starts at a second, and the suite cuts every
		// few tens of milliseconds.
		client = append(client,
			option.WithEndpoint("passthrough:///"+l.proxy.Addr()),
			option.WithGRPCDialOption(grpc.WithConnectParams(grpc.ConnectParams{
				Backoff:           backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 200 * time.Millisecond},
				MinConnectTimeout: 2 * time.Second,
			})))
	}
	opts = append([]datastorelock.Option{
		datastorelock.WithNamespace(namespace()),
		datastorelock.WithClientOptions(client...),
	}, opts...)
	b, err := datastorelock.New(context.Background(), project, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b, r
}

// faults implements storetest.Faults: a lost reply is a gRPC interceptor
// that lets the server apply the request and then reports Unavailable; a
// cut closes the TCP connections of a DropProxy between the backend and
// the emulator.
type faults struct {
	r *rpcs
	p *testsvc.DropProxy
}

func (f faults) LoseNextReply()  { f.r.loseNext.Store(true) }
func (f faults) CutConnections() { f.p.CutConnections() }

// contractBackend is a backend for the contract suite, reached through a
// DropProxy, with Faults.
func contractBackend(t *testing.T, l link, opts ...datastorelock.Option) (*datastorelock.Backend, storetest.Faults) {
	l.proxy = testsvc.NewDropProxy(t, testsvc.Datastore(t))
	b, r := newBackendVia(t, l, opts...)
	return b, faults{r: r, p: l.proxy}
}

func TestContract(t *testing.T) {
	testsvc.Datastore(t)
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		clock := fake.NewClock(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC))
		b, f := contractBackend(t, link{}, datastorelock.WithClock(clock.Now))
		return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: clock.Advance, Now: clock.Now, Faults: f}
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
		return storetest.Harness{Backend: b, TTL: ttl, Step: ttl / 10, Faults: f, HistoryOps: 3000}
	})
}

// skew is how far the client clocks of the server-clock tests are off: more
// than a lease and more than a ttl.
const skew = 3 * time.Hour

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
				server := fake.NewClock(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC))
				b, f := contractBackend(t, link{server: server.Now}, datastorelock.WithClock(skewed(server, c.off)))
				return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: server.Advance, Now: server.Now, Faults: f, HistoryOps: c.historyOps}
			})
		})
	}
}

// skewed is a client clock that reads server's time off by d.
func skewed(server *fake.Clock, d time.Duration) func() time.Time {
	return func() time.Time { return server.Now().Add(d) }
}

func TestNewRefusesBadConfiguration(t *testing.T) {
	t.Setenv("DATASTORE_PROJECT_ID", "")
	t.Setenv("GOOGLE_CLOUD_PROJECT", "")
	t.Setenv("DATASTORE_EMULATOR_HOST", "127.0.0.1:1")
	ctx := context.Background()
	if _, err := datastorelock.New(ctx, ""); err == nil || !strings.Contains(err.Error(), "project") {
		t.Errorf("no project: %v", err)
	}
	if _, err := datastorelock.New(ctx, "p", datastorelock.WithTTL(-1)); !errors.Is(err, store.ErrInvalidTTL) {
		t.Errorf("ttl -1: %v", err)
	}
	if _, err := datastorelock.New(ctx, "p", datastorelock.WithKind("__reserved__")); err == nil {
		t.Error("reserved kind accepted")
	}
	t.Setenv("GOOGLE_CLOUD_PROJECT", "from-env")
	b, err := datastorelock.New(ctx, "")
	if err != nil {
		t.Fatalf("project from GOOGLE_CLOUD_PROJECT: %v", err)
	}
	b.Close()
}

func TestNamesAreOneToOneAndFitDatastore(t *testing.T) {
	cases := map[string]string{
		"orders:PO-1":          "orders:PO-1",
		"ключ/鍵 x":             "ключ/鍵 x",
		"~tilde":               "~fnRpbGRl",
		"__reserved__":         "~X19yZXNlcnZlZF9f",
		"__prefix_only":        "__prefix_only",
		"\xff\xfe":             "~__4",
		"~X19yZXNlcnZlZF9f":    "~flgxOXlaWE5sY25abFpGOWY",
		strings.Repeat("é", 3): strings.Repeat("é", 3),
	}
	seen := map[string]string{}
	for k, want := range cases {
		got := datastorelock.Name(k)
		if got != want {
			t.Errorf("Name(%q) = %q, want %q", k, got, want)
		}
		if prev, ok := seen[got]; ok {
			t.Errorf("Name(%q) = Name(%q) = %q", k, prev, got)
		}
		seen[got] = k
	}
	if n := len(datastorelock.Name(strings.Repeat("\xff", store.MaxKeyLen))); n > 1500 {
		t.Fatalf("a %d-byte key maps to a %d-byte name, over Datastore's 1500", store.MaxKeyLen, n)
	}
}

func noop(context.Context) error { return nil }

// RPCs per delivery, on the emulator (the client's clock) and with replies
// that carry the server's time (the production service).
func TestRPCsPerDelivery(t *testing.T) {
	testsvc.Datastore(t)
	for _, mode := range []string{"client_clock", "server_clock"} {
		t.Run(mode, func(t *testing.T) {
			clock := fake.NewClock(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC))
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

func TestAStaleVersionIsFencedOutLikeAStaleFence(t *testing.T) {
	testsvc.Datastore(t)
	clock := fake.NewClock(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC))
	b, _ := newBackend(t, datastorelock.WithClock(clock.Now))
	ctx := t.Context()
	r1, _ := b.Claim(ctx, "k", time.Minute)
	clock.Advance(2 * time.Minute)
	r2, _ := b.Claim(ctx, "k", time.Minute)
	if r2.Outcome != store.Won || r2.Claim.Rev == r1.Claim.Rev {
		t.Fatalf("reclaim: %v rev %d (was %d)", r2.Outcome, r2.Claim.Rev, r1.Claim.Rev)
	}
	if ok, err := b.Complete(ctx, r1.Claim); ok || err != nil {
		t.Fatalf("zombie complete: %v %v, want false", ok, err)
	}
	// A stale version with the current fence (the claim was extended
	// through another copy) is re-read, not refused.
	ext, err := b.Extend(ctx, r2.Claim, time.Hour)
	if err != nil || ext.Rev == r2.Claim.Rev {
		t.Fatalf("extend: %v rev %d", err, ext.Rev)
	}
	if ok, err := b.Complete(ctx, r2.Claim); !ok || err != nil {
		t.Fatalf("complete with the current fence and an old version: %v %v", ok, err)
	}
	if r, _ := b.Claim(ctx, "k", time.Minute); r.Outcome != store.AlreadyDone {
		t.Fatalf("after complete: %v", r.Outcome)
	}
}

func TestLostCommitResponseIsReaffirmed(t *testing.T) {
	testsvc.Datastore(t)
	for _, path := range []string{"create", "reclaim"} {
		t.Run(path, func(t *testing.T) {
			clock := fake.NewClock(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC))
			b, r := newBackend(t, datastorelock.WithClock(clock.Now))
			ctx := t.Context()
			want := int64(1)
			if path == "reclaim" {
				b.Claim(ctx, "k", time.Minute) // a holder that crashed
				clock.Advance(2 * time.Minute)
				want = 2
			}
			r.loseNextCommit.Store(true)
			res, err := b.Claim(ctx, "k", time.Minute)
			if r.lost.Load() != 1 {
				t.Fatalf("%d responses lost, want 1", r.lost.Load())
			}
			if err != nil || res.Outcome != store.Won || res.Claim.Fence != want {
				t.Fatalf("claim after a lost commit response: %v fence %d %v; want won with fence %d (not locked out, not bumped twice)",
					res.Outcome, res.Claim.Fence, err, want)
			}
			if other, _ := b.Claim(ctx, "k", time.Minute); other.Outcome != store.HeldByOther {
				t.Fatalf("another claim: %v, want held by other", other.Outcome)
			}
			r.loseNextCommit.Store(true)
			if ok, err := b.Complete(ctx, res.Claim); !ok || err != nil {
				t.Fatalf("complete after a lost commit response: %v %v", ok, err)
			}
			if r.lost.Load() != 2 {
				t.Fatalf("the complete's response was not lost")
			}
			if again, _ := b.Claim(ctx, "k", time.Minute); again.Outcome != store.AlreadyDone {
				t.Fatalf("after complete: %v", again.Outcome)
			}
		})
	}
}

func TestLongAndOddKeysAreStored(t *testing.T) {
	testsvc.Datastore(t)
	b, _ := newBackend(t)
	ctx := t.Context()
	for _, k := range []string{strings.Repeat("\xfe", store.MaxKeyLen), "__reserved__", "~X19yZXNlcnZlZF9f", strings.Repeat("鍵", store.MaxKeyLen/3)} {
		r, err := b.Claim(ctx, k, time.Minute)
		if err != nil || r.Outcome != store.Won || r.Claim.Fence != 1 {
			t.Fatalf("%.12q...: %v fence %d %v", k, r.Outcome, r.Claim.Fence, err)
		}
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

// raceChild builds the backend a race child claims on.
func raceChild() int {
	b, err := datastorelock.New(context.Background(), project, datastorelock.WithNamespace(os.Getenv("HELPER_NS")))
	if err != nil {
		fmt.Println(err)
		return 1
	}
	defer b.Close()
	return testsvc.RaceChild(b)
}
