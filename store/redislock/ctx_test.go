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
// Here the server is gone (every dial is refused at once: go-redis does not
// redial within an attempt) and the retry budget is far beyond the
// deadline, which therefore ends in a wait between attempts or in one.
func TestCtxIsHonouredAndWrappedWhenItEndsBetweenRetries(t *testing.T) {
	port, err := testsvc.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	c := client(t, fmt.Sprintf("127.0.0.1:%d", port), oneDial)
	b := newBackend(t, c, redislock.WithRetries(1000))
	for _, op := range ops(b, store.Claim{Key: "k", Fence: 1, Token: "t"}) {
		short, cancel := context.WithTimeout(t.Context(), 150*time.Millisecond)
		start := time.Now()
		err := op.call(short)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s: %v, want an error wrapping context.DeadlineExceeded", op.name, err)
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Errorf("%s: returned %v after its 150ms deadline", op.name, d)
		}
	}
}

func TestCancelledContextDuringClaimIsReportedAsUnknown(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	ctx, cancel := context.WithTimeout(t.Context(), time.Nanosecond)
	defer cancel()
	<-ctx.Done()
	_, err := b.Claim(ctx, "k", time.Minute)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want DeadlineExceeded", err)
	}
}
