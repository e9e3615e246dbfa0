package fake_test

import (
	"context"
	"fmt"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
)

// A handler test drives time with a Clock instead of sleeping.
func ExampleStore() {
	clock := fake.NewClock(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC))
	s := fake.New(fake.WithClock(clock.Now), fake.WithTTL(time.Hour))
	ctx := context.Background()
	send := func(context.Context) error { fmt.Println("send"); return nil }

	_ = idempotency.Lock(ctx, s, "orders:PO-1", send)
	rec, _ := s.Record("orders:PO-1")
	fmt.Println(rec.State, "fence", rec.Fence, "until", rec.ExpiresAt.Format(time.Kitchen))

	fmt.Println(idempotency.Lock(ctx, s, "orders:PO-1", send))
	clock.Advance(time.Hour) // the ttl ends: a new occurrence runs
	fmt.Println(idempotency.Lock(ctx, s, "orders:PO-1", send))
	// Output:
	// send
	// done fence 1 until 1:00PM
	// idempotency: duplicate: key "orders:PO-1" already completed (suppressed until 2026-11-29T13:00:00Z)
	// send
	// <nil>
}

// FailNext injects a store fault, to test what a handler does when the
// store is down.
func ExampleStore_FailNext() {
	s := fake.New()
	s.FailNext(fake.OpClaim, fmt.Errorf("datastore unavailable"))
	err := idempotency.Lock(context.Background(), s, "k", func(context.Context) error { return nil })
	fmt.Println(err)
	// Output:
	// idempotency: claim "k": datastore unavailable
}
