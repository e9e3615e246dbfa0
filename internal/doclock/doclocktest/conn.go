package doclocktest

import (
	"io"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Conns is a driver's constructors on the emulator: New on a connection of
// the case's own, and Dial.
type Conns interface {
	// OnConn dials the emulator as a caller of New would (t's cleanup
	// closes it), and returns a function that builds a backend on that
	// connection with New in space, and one that reports whether the
	// connection is shut down.
	OnConn(t *testing.T) (newOn func(space string) (Backend, io.Closer, error), shutdown func() bool)
	// Dial builds a backend with Dial in space, after the emulator runs
	// (its address in the environment, as testsvc sets it).
	Dial(t *testing.T, space string) (Backend, io.Closer, error)
	// Code returns the gRPC code of err (as status.Code does).
	Code(err error) uint32
}

// RunConns runs the constructors' cases on d, each a subtest named after
// the behaviour it checks.
func RunConns(t *testing.T, d Driver, c Conns) {
	// New builds a working backend on a connection the test dialled, and
	// the backend's Close leaves that connection open and usable.
	t.Run("NewOnACallersConnectionLeavesItOpen", func(t *testing.T) {
		d.Emulator(t)
		newOn, shutdown := c.OnConn(t)
		ctx := t.Context()
		space := d.Space()
		b, closer, err := newOn(space)
		if err != nil {
			t.Fatal(err)
		}
		if ok, err := b.Complete(ctx, Claim(t, b, "k", time.Minute)); !ok || err != nil {
			t.Fatalf("complete: %v %v", ok, err)
		}
		if err := closer.Close(); err != nil {
			t.Fatalf("close: %v", err)
		}
		if shutdown() {
			t.Fatal("the caller's connection is shut down after the backend's Close")
		}
		again, _, err := newOn(space)
		if err != nil {
			t.Fatal(err)
		}
		if r, err := again.Claim(ctx, "k", time.Minute); err != nil || r.Outcome != store.AlreadyDone {
			t.Fatalf("a claim on the same connection after the first backend's Close: %v %v, want already done", r.Outcome, err)
		}
	})
	// Dial's backend owns the connection it dialled: its Close closes it,
	// and a call after that fails at once (Canceled: the connection is
	// closing) instead of reaching the service.
	t.Run("DialCloseClosesItsConnection", func(t *testing.T) {
		d.Emulator(t)
		ctx := t.Context()
		b, closer, err := c.Dial(t, d.Space())
		if err != nil {
			t.Fatal(err)
		}
		Claim(t, b, "k", time.Minute)
		if err := closer.Close(); err != nil {
			t.Fatalf("close: %v", err)
		}
		_, err = b.Claim(ctx, "k2", time.Minute)
		if c.Code(err) != 1 || ctx.Err() != nil {
			t.Fatalf("claim after Close: %v, want the closed connection's Canceled", err)
		}
	})
}
