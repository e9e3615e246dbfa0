package idempotency_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A context deadline centuries away makes WithLeaseFromDeadline claim with
// a lease of math.MaxInt64 (it saturates). The lease must hold the key:
// of two deliveries racing for one key, one runs the body and the other
// is in progress, and once the body returned the key is done. (On main at
// 72b2726 the SQL, Datastore, Firestore and Spanner backends rounded that
// lease into 1734, and both deliveries ran the body; the storetest rule
// leases_at_their_limit_never_expire_a_claim_early holds every backend to
// this.)
func TestLeaseFromAFarDeadlineHoldsTheKeyAgainstARacingDelivery(t *testing.T) {
	start := time.Now().Truncate(time.Second)
	clock := fake.NewClock(start)
	s := fake.New(fake.WithClock(clock.Now))
	ctx, cancel := context.WithDeadline(t.Context(), start.AddDate(400, 0, 0))
	defer cancel()
	opts := []idempotency.LockOption{idempotency.WithNow(clock.Now), idempotency.WithLeaseFromDeadline(5 * time.Second)}

	entered := make(chan store.Claim, 2)
	release := make(chan struct{})
	errs := make(chan error, 2)
	for range 2 {
		go func() {
			errs <- idempotency.Lock(ctx, s, "k", func(ctx context.Context) error {
				c, _ := idempotency.ClaimFrom(ctx)
				entered <- c
				<-release
				return nil
			}, opts...)
		}()
	}
	// The first body holds the key until the other delivery has returned.
	c := <-entered
	if want := start.Add(math.MaxInt64); c.LeaseExpiry.Before(want.Add(-time.Second)) {
		t.Fatalf("lease expiry %v, want %v (now + math.MaxInt64)", c.LeaseExpiry, want)
	}
	select {
	case err := <-errs:
		if !errors.Is(err, idempotency.ErrInProgress) {
			t.Fatalf("the racing delivery: %v, want ErrInProgress", err)
		}
	case c2 := <-entered:
		close(release)
		t.Fatalf("the body ran twice for one key: fences %d and %d", c.Fence, c2.Fence)
	}
	close(release)
	if err := <-errs; err != nil {
		t.Fatalf("the delivery that ran the body: %v", err)
	}
	// Later deliveries find the key done.
	err := idempotency.Lock(ctx, s, "k", func(context.Context) error {
		t.Fatal("the body ran again after the key was done")
		return nil
	}, opts...)
	if !errors.Is(err, idempotency.ErrDuplicate) {
		t.Fatalf("a later delivery: %v, want ErrDuplicate", err)
	}
}
