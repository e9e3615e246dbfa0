package enginetest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
)

// A context deadline centuries away makes WithLeaseFromDeadline claim
// with a lease of math.MaxInt64. That lease holds the key: a delivery of
// the same key that arrives while the body runs is in progress, and once
// the body returned the key is done. (millis rounded that lease to a
// negative count, a lease expiry in 1734: the second delivery won the key
// and ran the body beside the first.)
func TestLockWithAFarDeadlineRunsTheBodyOnce(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		_, b := e.fresh(t, nil)
		ctx, cancel := context.WithDeadline(t.Context(), time.Now().AddDate(400, 0, 0))
		defer cancel()
		opt := idempotency.WithLeaseFromDeadline(5 * time.Second)
		runs := 0
		err := idempotency.Lock(ctx, b, "k", func(ctx context.Context) error {
			runs++
			err := idempotency.Lock(ctx, b, "k", func(context.Context) error { runs++; return nil }, opt)
			if !errors.Is(err, idempotency.ErrInProgress) {
				t.Errorf("a second delivery while the body runs: %v, want ErrInProgress", err)
			}
			return nil
		}, opt)
		if err != nil || runs != 1 {
			t.Fatalf("Lock: %v; the body ran %d times, want once", err, runs)
		}
		if err := idempotency.Lock(ctx, b, "k", func(context.Context) error { runs++; return nil }, opt); !errors.Is(err, idempotency.ErrDuplicate) || runs != 1 {
			t.Fatalf("a later delivery: %v, the body ran %d times; want ErrDuplicate, once", err, runs)
		}
	})
}
