package datastorelock_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"sync/atomic"
	"testing"
	"time"

	pb "cloud.google.com/go/datastore/apiv1/datastorepb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// The scaffolding the package's tests share: the backends they build on
// the emulator, the faults they inject, the clocks they drive.

const project = "idempotency-test"

func TestMain(m *testing.M) {
	if testsvc.IsRaceChild() {
		os.Exit(raceChild())
	}
	code := m.Run()
	testsvc.StopAll()
	os.Exit(code)
}

// raceChild builds the backend a race child claims on, with Dial and the
// environment the parent passes (DATASTORE_EMULATOR_HOST).
func raceChild() int {
	b, err := datastorelock.Dial(context.Background(), project, datastorelock.WithNamespace(os.Getenv("HELPER_NS")))
	if err != nil {
		fmt.Println(err)
		return 1
	}
	defer b.Close()
	return testsvc.RaceChild(b)
}

func namespace() string { return fmt.Sprintf("t%016x", rand.Uint64()) }

// newClock returns a fake clock at the instant the tests start from.
func newClock() *fake.Clock { return fake.NewClock(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)) }

// rpcs counts the RPCs a backend sends and injects their faults
// (doclocktest.Calls), with Datastore's own hooks.
type rpcs struct {
	*doclocktest.Calls
	// afterLookup, when set, runs when a Lookup's reply has arrived,
	// before the backend hears of it.
	afterLookup func()
	// afterTxLookup, when set, runs when the reply of a Lookup in a
	// transaction has arrived, before the caller hears of it.
	afterTxLookup func()
	// began is the transaction of the latest BeginTransaction reply.
	began atomic.Pointer[[]byte]
}

func (r *rpcs) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	name, f := r.Before(method)
	if f != nil {
		return fault(f)
	}
	err := invoker(ctx, method, req, reply, cc, opts...)
	if err == nil && name == "Lookup" && r.afterLookup != nil {
		r.afterLookup()
	}
	if res, ok := reply.(*pb.BeginTransactionResponse); ok && err == nil {
		id := res.GetTransaction()
		r.began.Store(&id)
	}
	if lr, ok := req.(*pb.LookupRequest); ok && err == nil && lr.GetReadOptions().GetTransaction() != nil && r.afterTxLookup != nil {
		r.afterTxLookup()
	}
	if f := r.After(name, err); f != nil {
		return fault(f)
	}
	return err
}

// fault is the gRPC error of an injected fault.
func fault(f *doclocktest.Fault) error { return status.Error(codes.Code(f.Code), f.Msg) }

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

// dialEmulator opens a gRPC connection to addr (the emulator, or a proxy
// before it) as a caller of New would, without credentials; t's cleanup
// closes it.
func dialEmulator(t testing.TB, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	opts = append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)
	conn, err := grpc.NewClient("passthrough:///"+addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func newBackend(t testing.TB, opts ...datastorelock.Option) (*datastorelock.Backend, *rpcs) {
	t.Helper()
	return newBackendVia(t, link{}, opts...)
}

// newBackendVia builds a backend with New, in a namespace of its own
// (unless opts name one), on a connection of the test's own that counts
// its RPCs and injects their faults.
func newBackendVia(t testing.TB, l link, opts ...datastorelock.Option) (*datastorelock.Backend, *rpcs) {
	t.Helper()
	addr := testsvc.Datastore(t)
	r := &rpcs{Calls: &doclocktest.Calls{}}
	chain := []grpc.UnaryClientInterceptor{r.intercept}
	if l.server != nil {
		chain = append(chain, serverTime(l.server).intercept)
	}
	dial := []grpc.DialOption{grpc.WithChainUnaryInterceptor(chain...)}
	if l.proxy != nil {
		// Reconnect soon after a cut: gRPC's default backoff after a failed
		// connection attempt starts at a second, and the suite cuts every
		// few tens of milliseconds.
		addr = l.proxy.Addr()
		dial = append(dial, grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 200 * time.Millisecond},
			MinConnectTimeout: 2 * time.Second,
		}))
	}
	opts = append([]datastorelock.Option{datastorelock.WithNamespace(namespace())}, opts...)
	b, err := datastorelock.New(dialEmulator(t, addr, dial...), project, opts...)
	if err != nil {
		t.Fatal(err)
	}
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

func (f faults) LoseNextReply()  { f.r.LoseNext.Store(true) }
func (f faults) CutConnections() { f.p.CutConnections() }

// contractBackend is a backend for the contract suite, reached through a
// DropProxy, with Faults.
func contractBackend(t *testing.T, l link, opts ...datastorelock.Option) (*datastorelock.Backend, storetest.Faults) {
	l.proxy = testsvc.NewDropProxy(t, testsvc.Datastore(t))
	b, r := newBackendVia(t, l, opts...)
	return b, faults{r: r, p: l.proxy}
}

// skewed is a client clock that reads server's time off by d.
func skewed(server *fake.Clock, d time.Duration) func() time.Time {
	return func() time.Time { return server.Now().Add(d) }
}

// The lease and ttl of the server-clock tests.
const (
	scLease = time.Minute
	scTTL   = 10 * time.Minute
)

// onServer returns a backend whose replies carry server's time (as the
// production service's do; the emulator's carry none) and whose own clock
// is off it by off.
func onServer(t *testing.T, server *fake.Clock, ns string, off time.Duration) *datastorelock.Backend {
	t.Helper()
	b, _ := newBackendVia(t, link{server: server.Now},
		datastorelock.WithNamespace(ns), datastorelock.WithTTL(scTTL), datastorelock.WithClock(skewed(server, off)))
	return b
}
