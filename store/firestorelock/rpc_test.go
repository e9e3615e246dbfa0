package firestorelock_test

import (
	"context"
	"errors"
	"io"
	"sync/atomic"
	"testing"
	"time"

	pb "cloud.google.com/go/firestore/apiv1/firestorepb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
)

const (
	methodBatchGet = "/google.firestore.v1.Firestore/BatchGetDocuments"
	methodCommit   = "/google.firestore.v1.Firestore/Commit"
)

// scriptedConn is a connection that never reaches a server: it answers
// each call with what answer returns for it (nil: a read finds nothing,
// with no read_time; a write succeeds with an empty reply), and counts the
// calls by method.
type scriptedConn struct {
	reads, commits, others atomic.Int32
	answer                 func(ctx context.Context, method string) error
}

func (c *scriptedConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	if method == methodCommit {
		c.commits.Add(1)
	} else {
		c.others.Add(1)
	}
	return c.answer(ctx, method)
}

func (c *scriptedConn) NewStream(ctx context.Context, _ *grpc.StreamDesc, method string, _ ...grpc.CallOption) (grpc.ClientStream, error) {
	if method == methodBatchGet {
		c.reads.Add(1)
	} else {
		c.others.Add(1)
	}
	return &scriptedStream{ctx: ctx, err: c.answer(ctx, method)}, nil
}

func (c *scriptedConn) calls() int32 { return c.reads.Load() + c.commits.Load() + c.others.Load() }

// scriptedStream answers a read with err, or with one reply saying the
// document is missing.
type scriptedStream struct {
	ctx  context.Context
	err  error
	done bool
}

func (s *scriptedStream) Header() (metadata.MD, error) { return nil, nil }
func (s *scriptedStream) Trailer() metadata.MD         { return nil }
func (s *scriptedStream) CloseSend() error             { return nil }
func (s *scriptedStream) Context() context.Context     { return s.ctx }
func (s *scriptedStream) SendMsg(any) error            { return nil }
func (s *scriptedStream) RecvMsg(m any) error {
	if s.err != nil {
		return s.err
	}
	if s.done {
		return io.EOF
	}
	s.done = true
	if r, ok := m.(*pb.BatchGetDocumentsResponse); ok {
		r.Result = &pb.BatchGetDocumentsResponse_Missing{Missing: "scripted"}
	}
	return nil
}

// failing returns a scriptedConn whose every call fails with code.
func failing(code codes.Code) *scriptedConn {
	return &scriptedConn{answer: func(context.Context, string) error { return status.Error(code, "scripted failure") }}
}

func newOn(t *testing.T, conn *scriptedConn, opts ...firestorelock.Option) *firestorelock.Backend {
	t.Helper()
	b, err := firestorelock.New(conn, project, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// retryable is the exact set of codes after which an RPC is sent again.
var retryable = map[codes.Code]bool{
	codes.Unavailable: true, codes.Aborted: true, codes.ResourceExhausted: true, codes.Internal: true,
	codes.DeadlineExceeded: true, // a per-call deadline of the transport, while ctx is live
}

// Every RPC is sent again after the transient codes, WithRetries times,
// and after no other code; the call's error carries the last code.
func TestRetriesExactlyTheTransientCodes(t *testing.T) {
	const retries = 3
	for code := codes.Canceled; code <= codes.Unauthenticated; code++ {
		t.Run(code.String(), func(t *testing.T) {
			conn := failing(code)
			b := newOn(t, conn, firestorelock.WithRetries(retries))
			_, err := b.Claim(t.Context(), "k", time.Minute) // a first claim reads first
			want := int32(1)
			if retryable[code] {
				want = retries + 1
			}
			if got := conn.reads.Load(); got != want || conn.calls() != got || status.Code(err) != code {
				t.Fatalf("%d reads (%d calls in all), err %v; want %d reads and the error's code %v", got, conn.calls(), err, want, code)
			}
		})
	}
}

// Writes are retried like reads, and WithRetries(0) sends every RPC once.
func TestWithRetriesBoundsWritesAndReads(t *testing.T) {
	for _, retries := range []int{0, 2} {
		// The read finds nothing; the create that follows fails.
		conn := &scriptedConn{answer: func(_ context.Context, method string) error {
			if method == methodCommit {
				return status.Error(codes.Unavailable, "scripted failure")
			}
			return nil
		}}
		b := newOn(t, conn, firestorelock.WithRetries(retries))
		_, err := b.Claim(t.Context(), "k", time.Minute)
		if got := conn.commits.Load(); got != int32(retries+1) || conn.reads.Load() != 1 || status.Code(err) != codes.Unavailable {
			t.Errorf("WithRetries(%d): %d commits after %d reads, err %v; want %d commits after 1 read, Unavailable",
				retries, got, conn.reads.Load(), err, retries+1)
		}
	}
}

// A ctx that ends while the backend waits to retry ends the wait, and the
// error wraps both the ctx's error and the last RPC's.
func TestContextEndingDuringTheWaitWrapsBothErrors(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	conn := failing(codes.Unavailable)
	b := newOn(t, conn, firestorelock.WithRetries(1_000_000))
	start := time.Now()
	_, err := b.Claim(ctx, "k", time.Minute)
	if !errors.Is(err, context.DeadlineExceeded) || status.Code(err) != codes.Unavailable {
		t.Fatalf("err %v; want one wrapping context.DeadlineExceeded and Unavailable", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the call took %v after its ctx's 50ms deadline", d)
	}
}

// No method sends anything on a ctx that has ended, and each returns an
// error wrapping the ctx's.
func TestAnEndedContextSendsNothing(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	c := store.Claim{Key: "k", Fence: 1, Token: "t", LeaseExpiry: time.Now().Add(time.Minute), Rev: 1}
	for name, call := range map[string]func(*firestorelock.Backend) error{
		"claim":    func(b *firestorelock.Backend) error { _, err := b.Claim(ctx, "k", time.Minute); return err },
		"complete": func(b *firestorelock.Backend) error { _, err := b.Complete(ctx, c); return err },
		"release":  func(b *firestorelock.Backend) error { return b.Release(ctx, c) },
		"extend":   func(b *firestorelock.Backend) error { _, err := b.Extend(ctx, c, time.Minute); return err },
		"purge":    func(b *firestorelock.Backend) error { _, err := b.PurgeExpired(ctx, 0); return err },
	} {
		conn := failing(codes.Unavailable)
		if err := call(newOn(t, conn)); !errors.Is(err, context.Canceled) || conn.calls() != 0 {
			t.Errorf("%s: err %v after %d calls; want context.Canceled and none", name, err, conn.calls())
		}
	}
}
