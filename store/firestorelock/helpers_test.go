package firestorelock_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	pb "cloud.google.com/go/firestore/apiv1/firestorepb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
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
// environment the parent passes (FIRESTORE_EMULATOR_HOST).
func raceChild() int {
	b, err := firestorelock.Dial(context.Background(), project, firestorelock.WithCollection(os.Getenv("HELPER_COLLECTION")))
	if err != nil {
		fmt.Println(err)
		return 1
	}
	defer b.Close()
	return testsvc.RaceChild(b)
}

// collection returns a collection ID of the test's own.
func collection() string { return fmt.Sprintf("t%016x", rand.Uint64()) }

// rpcs counts the RPCs a backend sends (unary and streaming) and injects
// their faults (doclocktest.Calls).
type rpcs struct{ *doclocktest.Calls }

func (r rpcs) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	name, f := r.Before(method)
	if f != nil {
		return fault(f)
	}
	err := invoker(ctx, method, req, reply, cc, opts...)
	if f := r.After(name, err); f != nil {
		return fault(f)
	}
	return err
}

// fault is the gRPC error of an injected fault.
func fault(f *doclocktest.Fault) error { return status.Error(codes.Code(f.Code), f.Msg) }

func (r rpcs) interceptStream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	r.Before(method)
	s, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		return nil, err
	}
	return &losingStream{ClientStream: s, r: r}, nil
}

// losingStream loses a streamed reply when the next reply is set to be
// lost.
type losingStream struct {
	grpc.ClientStream
	r rpcs
}

func (s *losingStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if err == nil && s.r.LoseStreamed() {
		return status.Error(codes.Unavailable, "injected: the reply was lost")
	}
	return err
}

// serverTime stands in for the service's clock so that tests can drive
// it: it replaces read_time in BatchGetDocuments and RunQuery replies and
// commit_time in Commit replies with its own clock, read as the request
// leaves. It leaves update_time alone: that is the documents' version,
// which preconditions compare, not a clock the backend reads.
type serverTime func() time.Time

func (now serverTime) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	ts := timestamppb.New(now())
	if err := invoker(ctx, method, req, reply, cc, opts...); err != nil {
		return err
	}
	if r, ok := reply.(*pb.CommitResponse); ok {
		r.CommitTime = ts
	}
	return nil
}

func (now serverTime) interceptStream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	ts := timestamppb.New(now())
	s, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		return nil, err
	}
	return &stampedStream{ClientStream: s, ts: ts}, nil
}

// stampedStream sets the read_time of every reply to ts.
type stampedStream struct {
	grpc.ClientStream
	ts *timestamppb.Timestamp
}

func (s *stampedStream) RecvMsg(m any) error {
	if err := s.ClientStream.RecvMsg(m); err != nil {
		return err
	}
	switch r := m.(type) {
	case *pb.BatchGetDocumentsResponse:
		r.ReadTime = s.ts
	case *pb.RunQueryResponse:
		if r.ReadTime != nil {
			r.ReadTime = s.ts
		}
	}
	return nil
}

// link says how a test backend reaches the emulator.
type link struct {
	// server, when set, is the service's clock its replies report
	// (else the emulator's own, the real time).
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

// newBackendVia builds a backend with New, in a collection of its own
// (unless opts name one), on a connection of the test's own that counts
// its RPCs and injects their faults.
func newBackendVia(t testing.TB, l link, opts ...firestorelock.Option) (*firestorelock.Backend, *rpcs) {
	t.Helper()
	addr := testsvc.Firestore(t)
	r := &rpcs{Calls: &doclocktest.Calls{}}
	unary := []grpc.UnaryClientInterceptor{r.intercept}
	stream := []grpc.StreamClientInterceptor{r.interceptStream}
	if l.server != nil {
		unary = append(unary, serverTime(l.server).intercept)
		stream = append(stream, serverTime(l.server).interceptStream)
	}
	dial := []grpc.DialOption{grpc.WithChainUnaryInterceptor(unary...), grpc.WithChainStreamInterceptor(stream...)}
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
	opts = append([]firestorelock.Option{firestorelock.WithCollection(collection())}, opts...)
	b, err := firestorelock.New(dialEmulator(t, addr, dial...), project, opts...)
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
func contractBackend(t *testing.T, l link, opts ...firestorelock.Option) (*firestorelock.Backend, storetest.Faults) {
	l.proxy = testsvc.NewDropProxy(t, testsvc.Firestore(t))
	// More resends than the default: the suite cuts the connections every
	// few tens of milliseconds, and on a loaded machine the emulator can
	// take longer than the default's waits (about 300ms in all) to accept
	// the proxy's next one.
	opts = append([]firestorelock.Option{firestorelock.WithRetries(10)}, opts...)
	b, r := newBackendVia(t, l, opts...)
	return b, faults{r: r, p: l.proxy}
}

// The lease and ttl of the server-clock tests.
const ()
