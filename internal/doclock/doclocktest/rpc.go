package doclocktest

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Scripted builds a driver's backends on connections that never reach a
// server, for the cases of the retries.
type Scripted interface {
	// NewScripted returns a backend built as c says on a connection that
	// answers each call, of kind "read", "commit" or "other", with what
	// answer returns (nil: a read finds nothing, with no read time; a
	// write succeeds with an empty reply), and counts the calls by kind.
	NewScripted(t testing.TB, c Config, answer func(ctx context.Context, kind string) error) (Backend, *Counts)
	// Status returns a gRPC status error of code; Code returns the gRPC
	// code of err (as status.Code does).
	Status(code uint32) error
	Code(err error) uint32
}

// Counts are the calls of a scripted connection, by kind.
type Counts struct{ Reads, Commits, Others atomic.Int32 }

// All is the number of calls.
func (c *Counts) All() int32 { return c.Reads.Load() + c.Commits.Load() + c.Others.Load() }

// The gRPC codes, by number, from Canceled (1) to Unauthenticated (16).
var codeNames = []string{1: "Canceled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound", "AlreadyExists",
	"PermissionDenied", "ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented", "Internal",
	"Unavailable", "DataLoss", "Unauthenticated"}

// retryable is the exact set of codes after which an RPC is sent again:
// DeadlineExceeded (a per-call deadline of the transport, while ctx is
// live), ResourceExhausted, Aborted, Internal, Unavailable.
var retryable = map[uint32]bool{4: true, 8: true, 10: true, 13: true, 14: true}

// RunScripted runs the cases of the retries on s, each a subtest named
// after the behaviour it checks.
func RunScripted(t *testing.T, s Scripted) {
	failing := func(t *testing.T, code uint32, c Config) (Backend, *Counts) {
		return s.NewScripted(t, c, func(context.Context, string) error { return s.Status(code) })
	}
	// Every RPC is sent again after the transient codes, WithRetries
	// times, and after no other code; the call's error carries the last
	// code.
	t.Run("RetriesExactlyTheTransientCodes", func(t *testing.T) {
		const retries = 3
		for code := uint32(1); code < uint32(len(codeNames)); code++ {
			t.Run(codeNames[code], func(t *testing.T) {
				b, n := failing(t, code, Config{Retries: Retries(retries)})
				_, err := b.Claim(t.Context(), "k", time.Minute) // a first claim reads first
				want := int32(1)
				if retryable[code] {
					want = retries + 1
				}
				if got := n.Reads.Load(); got != want || n.All() != got || s.Code(err) != code {
					t.Fatalf("%d reads (%d calls in all), err %v; want %d reads and the error's code %v", got, n.All(), err, want, codeNames[code])
				}
			})
		}
	})
	// Writes are retried like reads, and WithRetries(0) sends every RPC
	// once.
	t.Run("WithRetriesBoundsWritesAndReads", func(t *testing.T) {
		for _, retries := range []int{0, 2} {
			// The read finds nothing; the create that follows fails.
			b, n := s.NewScripted(t, Config{Retries: Retries(retries)}, func(_ context.Context, kind string) error {
				if kind == "commit" {
					return s.Status(14)
				}
				return nil
			})
			_, err := b.Claim(t.Context(), "k", time.Minute)
			if got := n.Commits.Load(); got != int32(retries+1) || n.Reads.Load() != 1 || s.Code(err) != 14 {
				t.Errorf("WithRetries(%d): %d commits after %d reads, err %v; want %d commits after 1 read, Unavailable",
					retries, got, n.Reads.Load(), err, retries+1)
			}
		}
	})
	// A ctx that ends during an RPC that then fails stops the retries, and
	// the error wraps both the ctx's error and the RPC's, for errors.Is
	// and status.Code.
	t.Run("ContextEndingDuringACallWrapsBothErrors", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		b, n := s.NewScripted(t, Config{}, func(context.Context, string) error {
			cancel()
			return s.Status(14)
		})
		_, err := b.Claim(ctx, "k", time.Minute)
		if !errors.Is(err, context.Canceled) || s.Code(err) != 14 || n.All() != 1 {
			t.Fatalf("err %v after %d calls; want one call and an error wrapping context.Canceled and Unavailable", err, n.All())
		}
	})
	// A ctx that ends while the backend waits to retry ends the wait, and
	// the error wraps both the ctx's error and the last RPC's.
	t.Run("ContextEndingDuringTheWaitWrapsBothErrors", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
		defer cancel()
		b, _ := failing(t, 14, Config{Retries: Retries(1_000_000)})
		start := time.Now()
		_, err := b.Claim(ctx, "k", time.Minute)
		if !errors.Is(err, context.DeadlineExceeded) || s.Code(err) != 14 {
			t.Fatalf("err %v; want one wrapping context.DeadlineExceeded and Unavailable", err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Fatalf("the call took %v after its ctx's 50ms deadline", d)
		}
	})
	// No method sends anything on a ctx that has ended, and each returns
	// an error wrapping the ctx's.
	t.Run("AnEndedContextSendsNothing", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		c := store.Claim{Key: "k", Fence: 1, Token: "t", LeaseExpiry: time.Now().Add(time.Minute), Rev: 1}
		for name, call := range map[string]func(Backend) error{
			"claim":    func(b Backend) error { _, err := b.Claim(ctx, "k", time.Minute); return err },
			"complete": func(b Backend) error { _, err := b.Complete(ctx, c); return err },
			"release":  func(b Backend) error { return b.Release(ctx, c) },
			"extend":   func(b Backend) error { _, err := b.Extend(ctx, c, time.Minute); return err },
			"purge":    func(b Backend) error { _, err := b.PurgeExpired(ctx, 0); return err },
		} {
			b, n := failing(t, 14, Config{})
			if err := call(b); !errors.Is(err, context.Canceled) || n.All() != 0 {
				t.Errorf("%s: err %v after %d calls; want context.Canceled and none", name, err, n.All())
			}
		}
	})
}

// RPCs per delivery, counted by the driver's interceptor (unary and
// streaming calls), with replies that carry the server's time (the
// production service) and, where the emulator stamps none, on the
// client's clock alone.
func rpcsPerDelivery(t *testing.T, drv h) {
	drv.Emulator(t)
	modes := []string{"server_clock"}
	if !drv.StampsTime() {
		modes = append(modes, "client_clock")
	}
	for _, mode := range modes {
		t.Run(mode, func(t *testing.T) {
			clock := NewClock()
			c := Config{Clock: clock.Now}
			if mode == "server_clock" {
				c.Server = clock.Now
			}
			b, r := drv.New(t, c)
			ctx := t.Context()
			check := func(what string, want int, run func()) {
				t.Helper()
				r.Take()
				run()
				if calls := r.Take(); len(calls) != want {
					t.Errorf("%s: %d RPCs %v, want %d", what, len(calls), calls, want)
				}
			}
			noop := func(context.Context) error { return nil }
			check("a backend's first delivery (read for the clock + create + conditioned update)", 3, func() { idempotency.Lock(ctx, b, "first", noop) })
			check("fresh key (create + conditioned update)", 2, func() { idempotency.Lock(ctx, b, "fresh", noop) })
			check("duplicate (create refused + read)", 2, func() { idempotency.Lock(ctx, b, "fresh", noop) })
			b.Claim(ctx, "crashed", time.Minute)
			check("held by a live lease (create refused + read)", 2, func() { idempotency.Lock(ctx, b, "crashed", noop) })
			clock.Advance(2 * time.Minute)
			if mode == "server_clock" {
				// The server's time is two minutes old: read first.
				check("reclaim after the lease (read + update, then update)", 3, func() { idempotency.Lock(ctx, b, "crashed", noop) })
			} else {
				check("reclaim after the lease (create refused + read + update, then update)", 4, func() { idempotency.Lock(ctx, b, "crashed", noop) })
			}
			check("mutex (create + conditioned update)", 2, func() { idempotency.Mutex(ctx, b, "po", noop) })
			check("mutex again (create refused + read + update, then update)", 4, func() { idempotency.Mutex(ctx, b, "po", noop) })
			cl, _ := b.Claim(ctx, "ext", time.Minute)
			check("extend (conditioned update)", 1, func() { b.Extend(ctx, cl.Claim, time.Minute) })
		})
	}
}

func init() { add(testCase{"RPCsPerDelivery", rpcsPerDelivery}) }
