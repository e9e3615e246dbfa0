package spannerlock_test

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"cloud.google.com/go/spanner"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
)

// The scaffolding the package's tests share: databases of their own on the
// emulator, clients that count RPCs and lose replies, a proxy that cuts.

func TestMain(m *testing.M) {
	if testsvc.IsRaceChild() {
		os.Exit(raceChild())
	}
	if os.Getenv(crashChildEnv) != "" {
		os.Exit(crashChild())
	}
	// The contract suite's cases mostly wait for leases and ttls to lapse
	// in real time: run them side by side, beyond GOMAXPROCS, unless
	// -parallel says otherwise.
	flag.Parse()
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if !set {
		flag.Set("test.parallel", "40")
	}
	code := m.Run()
	testsvc.StopAll()
	os.Exit(code)
}

// raceChild builds the backend a race child claims on, with Dial and the
// environment the parent passes (SPANNER_EMULATOR_HOST, HELPER_DB).
func raceChild() int {
	b, err := spannerlock.Dial(context.Background(), os.Getenv("HELPER_DB"))
	if err != nil {
		fmt.Println(err)
		return 1
	}
	defer b.Close()
	return testsvc.RaceChild(b)
}

// database creates a database of the test's own with the backend's table.
func database(t testing.TB) string {
	t.Helper()
	b, err := spannerlock.New(&spanner.Client{})
	if err != nil {
		t.Fatal(err)
	}
	return testsvc.SpannerDatabase(t, b.Schema())
}

// rpcs counts the RPCs a client sends and can lose a reply after the
// server applied the request.
type rpcs struct {
	mu    sync.Mutex
	calls []string
	// spent is the time each method's calls took, summed: a unary call
	// until its reply, a stream until its end.
	spent map[string]time.Duration
	// loseNext loses the reply of the next unary RPC, whatever its method.
	loseNext atomic.Bool
	// loseNextCommit loses the reply of the next Commit.
	loseNextCommit atomic.Bool
	lost           atomic.Int32
	// lostCode is the error a lost reply reports: Unavailable when zero
	// (the Spanner client resends a Commit after it), or another code
	// that reaches the backend (DeadlineExceeded, as a timed-out call).
	lostCode codes.Code
	// lostMsg is the message of a lost reply's error; a default one
	// when empty.
	lostMsg string
	// whileLost, when set, runs after a reply was lost, before the client
	// hears of it.
	whileLost func()
	// refuse fails the next RPC of method refuse.method with refuse.code
	// without sending it: a failure that certainly applied nothing.
	refuse  atomic.Pointer[refusal]
	refused atomic.Int32
}

// refusal is an RPC that rpcs fails before it is sent.
type refusal struct {
	method string
	code   codes.Code
	// msg is the error's message; a default one when empty.
	msg string
	// meanwhile, when set, runs before the client hears of the refusal.
	meanwhile func()
}

// refused reports whether the RPC called name is to fail unsent, and
// consumes the refusal.
func (r *rpcs) refusing(name string) bool {
	f := r.refuse.Load()
	if f == nil || f.method != name || !r.refuse.CompareAndSwap(f, nil) {
		return false
	}
	r.refused.Add(1)
	return true
}

func (r *rpcs) record(method string) string {
	name := method[strings.LastIndexByte(method, '/')+1:]
	r.mu.Lock()
	r.calls = append(r.calls, name)
	r.mu.Unlock()
	return name
}

// took adds d to the time spent in method name.
func (r *rpcs) took(name string, d time.Duration) {
	r.mu.Lock()
	if r.spent == nil {
		r.spent = map[string]time.Duration{}
	}
	r.spent[name] += d
	r.mu.Unlock()
}

// takeSpent returns the time spent per method since the last takeSpent.
func (r *rpcs) takeSpent() map[string]time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.spent
	r.spent = nil
	return s
}

func (r *rpcs) unary(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	name := r.record(method)
	defer func(start time.Time) { r.took(name, time.Since(start)) }(time.Now())
	if f := r.refuse.Load(); f != nil && r.refusing(name) {
		if f.meanwhile != nil {
			f.meanwhile()
		}
		return status.Error(f.code, cmp.Or(f.msg, "injected: refused before it was sent"))
	}
	err := invoker(ctx, method, req, reply, cc, opts...)
	if err == nil && (r.loseNext.CompareAndSwap(true, false) || name == "Commit" && r.loseNextCommit.CompareAndSwap(true, false)) {
		r.lost.Add(1)
		if r.whileLost != nil {
			r.whileLost()
		}
		code := r.lostCode
		if code == codes.OK {
			code = codes.Unavailable
		}
		msg := r.lostMsg
		if msg == "" {
			msg = "injected: the request applied but its reply was lost"
		}
		return status.Error(code, msg)
	}
	return err
}

func (r *rpcs) stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	name := r.record(method)
	if f := r.refuse.Load(); f != nil && r.refusing(name) {
		return nil, status.Error(f.code, "injected: refused before it was sent")
	}
	s, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		return s, err
	}
	return &timedStream{ClientStream: s, r: r, name: name, start: time.Now()}, nil
}

// timedStream adds a stream's time, from its start to the end of its
// replies, to the time spent in its method.
type timedStream struct {
	grpc.ClientStream
	r     *rpcs
	name  string
	start time.Time
	once  sync.Once
}

func (s *timedStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if err != nil {
		s.once.Do(func() { s.r.took(s.name, time.Since(s.start)) })
	}
	return err
}

// take returns the RPCs sent since the last take, leaving out the
// client's background session and metadata traffic.
func (r *rpcs) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, c := range r.calls {
		switch c {
		case "CreateSession", "BatchCreateSessions", "GetSession":
			continue
		}
		out = append(out, c)
	}
	r.calls = nil
	return out
}

// newClient opens a Spanner client for db as a caller of New would,
// through addr (the emulator, or a proxy before it), counting its RPCs in
// r; t's cleanup closes it.
func newClient(t testing.TB, db, addr string, r *rpcs) *spanner.Client {
	t.Helper()
	opts := []option.ClientOption{
		option.WithEndpoint("passthrough:///" + addr),
		option.WithoutAuthentication(),
		option.WithGRPCDialOption(grpc.WithTransportCredentials(insecure.NewCredentials())),
		option.WithGRPCDialOption(grpc.WithChainUnaryInterceptor(r.unary)),
		option.WithGRPCDialOption(grpc.WithChainStreamInterceptor(r.stream)),
		// Reconnect soon after a cut: gRPC's default backoff after a
		// failed connection attempt starts at a second.
		option.WithGRPCDialOption(grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 200 * time.Millisecond},
			MinConnectTimeout: 2 * time.Second,
		})),
		option.WithGRPCConnectionPool(1),
	}
	c, err := spanner.NewClientWithConfig(context.Background(), db, spanner.ClientConfig{DisableNativeMetrics: true}, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// newBackend builds a backend with New on a database of its own (unless
// db is given), on a client that counts its RPCs.
func newBackend(t testing.TB, db string, opts ...spannerlock.Option) (*spannerlock.Backend, *rpcs) {
	t.Helper()
	addr := testsvc.Spanner(t)
	if db == "" {
		db = database(t)
	}
	r := &rpcs{}
	b, err := spannerlock.New(newClient(t, db, addr, r), opts...)
	if err != nil {
		t.Fatal(err)
	}
	return b, r
}

// faults implements storetest.Faults: a lost reply is a gRPC interceptor
// that lets the server apply the next Commit and then reports Unavailable
// (only a Commit applies anything; a lost reply to the statement that
// began a transaction inline leaves that transaction open on the server,
// unknown to the client, until the server times it out: real Spanner
// after about 10s idle, the emulator later, and it stalls every other
// transaction of the database meanwhile); a cut closes the TCP
// connections of a DropProxy between the client and the emulator.
type faults struct {
	r *rpcs
	p *testsvc.DropProxy
}

func (f faults) LoseNextReply()  { f.r.loseNextCommit.Store(true) }
func (f faults) CutConnections() { f.p.CutConnections() }

// shardedBackend is n backends, each on a database of its own, all
// reached through one DropProxy by clients that share one rpcs: a lost
// reply is the next Commit's, whichever database it goes to, and a cut
// cuts them all.
func shardedBackend(t *testing.T, n int, opts ...spannerlock.Option) (shards, faults) {
	t.Helper()
	p := testsvc.NewDropProxy(t, testsvc.Spanner(t))
	r := &rpcs{}
	var s shards
	for range n {
		b, err := spannerlock.New(newClient(t, database(t), p.Addr(), r), opts...)
		if err != nil {
			t.Fatal(err)
		}
		s = append(s, b)
	}
	return s, faults{r: r, p: p}
}
