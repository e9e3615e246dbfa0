package enginetest

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// The port: every method MUST honour ctx, returning promptly once it is
// done with an error that wraps ctx.Err() when the call did not finish.
// Here every connection attempt fails with a transient network error, so
// the backend retries with backoff (a retry budget far beyond the
// deadline); the deadline ends during a backoff or an attempt, and each
// method must say so in a way errors.Is sees, not with the last network
// error alone.
func TestCtxIsHonouredAndWrappedWhenItEndsBetweenRetries(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		c := &counter{}
		db, b := e.fresh(t, c, sqllock.WithRetries(1000))
		ctx := t.Context()
		r, err := b.Claim(ctx, "k", time.Minute)
		if err != nil || r.Outcome != store.Won {
			t.Fatalf("claim: %v %v", r, err)
		}
		refuse := func(context.Context) error {
			return &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
		}
		c.onConnect.Store(&refuse)
		db.SetMaxIdleConns(0) // every call needs a new connection
		calls := map[string]func(context.Context) error{
			"claim":    func(ctx context.Context) error { _, err := b.Claim(ctx, "k2", time.Minute); return err },
			"complete": func(ctx context.Context) error { _, err := b.Complete(ctx, r.Claim); return err },
			"release":  func(ctx context.Context) error { return b.Release(ctx, r.Claim) },
			"extend":   func(ctx context.Context) error { _, err := b.Extend(ctx, r.Claim, time.Minute); return err },
			"purge":    func(ctx context.Context) error { _, err := b.PurgeExpired(ctx, 0); return err },
		}
		for name, call := range calls {
			short, cancel := context.WithTimeout(ctx, 150*time.Millisecond)
			start := time.Now()
			err := call(short)
			cancel()
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("%s: %v, want an error wrapping context.DeadlineExceeded", name, err)
			}
			if d := time.Since(start); d > 2*time.Second {
				t.Errorf("%s: returned %v after its 150ms deadline", name, d)
			}
		}
	})
}
