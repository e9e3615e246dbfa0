package redislock_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// The port: every method MUST honour ctx, returning promptly once it is
// done with an error that wraps ctx.Err() when the call did not finish.
// Here the server is gone (every dial is refused) and the retry budget is
// far beyond the deadline.
func TestCtxIsHonouredAndWrappedWhenItEndsBetweenRetries(t *testing.T) {
	port, err := testsvc.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	c := client(t, fmt.Sprintf("127.0.0.1:%d", port))
	b := newBackend(t, c, redislock.WithClaimRetries(1000))
	cl := store.Claim{Key: "k", Fence: 1, Token: "t"}
	calls := map[string]func(context.Context) error{
		"claim":    func(ctx context.Context) error { _, err := b.Claim(ctx, "k", time.Minute); return err },
		"complete": func(ctx context.Context) error { _, err := b.Complete(ctx, cl); return err },
		"release":  func(ctx context.Context) error { return b.Release(ctx, cl) },
		"extend":   func(ctx context.Context) error { _, err := b.Extend(ctx, cl, time.Minute); return err },
	}
	for name, call := range calls {
		short, cancel := context.WithTimeout(t.Context(), 150*time.Millisecond)
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
}
