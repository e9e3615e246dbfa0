package admin_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/admin"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// start is the fake clock's first reading in the examples.
var start = time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)

// done claims and completes key on s.
func done(s *fake.Store, key string) {
	ctx := context.Background()
	res, _ := s.Claim(ctx, key, time.Minute)
	s.Complete(ctx, res.Claim)
}

func ExampleGet() {
	clock := fake.NewClock(start)
	s := fake.New(fake.WithClock(clock.Now), fake.WithTTL(time.Hour))
	done(s, "orders:PO-1")
	clock.Advance(10 * time.Minute)

	r, _ := admin.Get(context.Background(), s, "orders:PO-1")
	fmt.Println(r.State, "fence", r.Fence, "done at", admin.DoneAt(r, time.Hour).Format(time.Kitchen), "reclaimable", r.Reclaimable())
	_, err := admin.Get(context.Background(), s, "orders:PO-2")
	fmt.Println(errors.Is(err, admin.ErrNotFound))
	// Output:
	// done fence 1 done at 12:00PM reclaimable false
	// true
}

func ExampleList() {
	s := fake.New(fake.WithClock(fake.NewClock(start).Now))
	for _, k := range []string{"orders:PO-1", "orders:PO-2", "orders:PO-3", "users:U-1"} {
		done(s, k)
	}
	s.Claim(context.Background(), "orders:PO-4", time.Minute)

	// Pages of two records; the iterator follows the cursors.
	q := store.ListQuery{Prefix: "orders:", State: store.Done, Limit: 2}
	for r, err := range admin.List(context.Background(), s, q) {
		if err != nil {
			fmt.Println(err)
			break
		}
		fmt.Println(r.Key, r.State)
	}
	// Output:
	// orders:PO-1 done
	// orders:PO-2 done
	// orders:PO-3 done
}

func ExampleCount() {
	clock := fake.NewClock(start)
	s := fake.New(fake.WithClock(clock.Now), fake.WithTTL(time.Hour))
	ctx := context.Background()
	done(s, "orders:PO-1")                      // done at 12:00, expires at 13:00
	s.Claim(ctx, "orders:PO-2", 10*time.Minute) // lease until 12:10
	clock.Advance(30 * time.Minute)             // 12:30
	done(s, "orders:PO-3")                      // done at 12:30
	s.Claim(ctx, "orders:PO-4", 10*time.Minute) // lease until 12:40
	clock.Advance(45 * time.Minute)             // 13:15: PO-1's ttl ended
	s.Claim(ctx, "orders:PO-5", 10*time.Minute) // lease until 13:25

	c, _ := admin.Count(ctx, s, "orders:")
	fmt.Printf("%+v total %d\n", c, c.Total())
	// Output:
	// {ClaimedLive:1 ClaimedLapsed:2 DoneLive:1 DoneExpired:1} total 5
}

func ExampleRelease() {
	clock := fake.NewClock(start)
	s := fake.New(fake.WithClock(clock.Now))
	ctx := context.Background()
	res, _ := s.Claim(ctx, "orders:PO-1", 15*time.Minute) // a holder hangs with this claim
	clock.Advance(time.Minute)

	ch, err := admin.Release(ctx, s, "orders:PO-1")
	fmt.Println(err)
	fmt.Println("before:", ch.Before.State, "fence", ch.Before.Fence, "lease until", ch.Before.LeaseExpiry.Format(time.Kitchen))
	fmt.Println("after: ", ch.After.State, "fence", ch.After.Fence, "lease until", ch.After.LeaseExpiry.Format(time.Kitchen), "reclaimable", ch.After.Reclaimable())

	// The hung holder is fenced out; the next delivery wins the key.
	ok, _ := s.Complete(ctx, res.Claim)
	fmt.Println("old holder completes:", ok)
	next, _ := s.Claim(ctx, "orders:PO-1", 15*time.Minute)
	fmt.Println("next delivery:", next.Outcome, "fence", next.Claim.Fence)

	_, err = admin.Release(ctx, s, "orders:PO-2")
	fmt.Println(err)
	// Output:
	// <nil>
	// before: claimed fence 1 lease until 12:15PM
	// after:  claimed fence 2 lease until 12:01PM reclaimable true
	// old holder completes: false
	// next delivery: won fence 3
	// admin: no record for the key: "orders:PO-2"
}

func ExampleForget() {
	s := fake.New(fake.WithClock(fake.NewClock(start).Now))
	ctx := context.Background()
	done(s, "orders:PO-1")

	ch, err := admin.Forget(ctx, s, "orders:PO-1")
	fmt.Println(err, ch.Before.State, ch.After == nil)
	res, _ := s.Claim(ctx, "orders:PO-1", time.Minute) // the replayed message runs again
	fmt.Println(res.Outcome)

	_, err = admin.Forget(ctx, s, "orders:PO-1") // now a live claim: never forgotten
	fmt.Println(err)
	// Output:
	// <nil> done true
	// won
	// admin: the record is not done: "orders:PO-1" is claimed with a live lease: a delivery is running the work, which runs again only if it fails; if its holder is gone, release the key instead
}

// A replay after a fix: forget the orders completed while the bad version
// ran (12:10 to 12:40), then seek the subscription back.
func ExampleForgetDone() {
	clock := fake.NewClock(start)
	s := fake.New(fake.WithClock(clock.Now), fake.WithTTL(time.Hour))
	ctx := context.Background()
	for _, k := range []string{"orders:PO-1", "orders:PO-2", "orders:PO-3", "orders:PO-4"} {
		done(s, k) // at 12:00, 12:20, 12:40, 13:00
		clock.Advance(20 * time.Minute)
	}
	f := admin.Filter{
		Prefix:     "orders:",
		DoneFrom:   start.Add(10 * time.Minute),
		DoneBefore: start.Add(40 * time.Minute),
		TTL:        time.Hour, // the service's ttl: done at = expires at - ttl
	}

	plan, _ := admin.ForgetDone(ctx, s, f, true) // dry run
	for _, r := range plan.Plan {
		fmt.Println("plan:", r.Key, "done at", admin.DoneAt(r, f.TTL).Format(time.Kitchen))
	}
	rep, err := admin.ForgetDone(ctx, s, f, false)
	fmt.Println(err, len(rep.Forgotten), "forgotten", len(rep.Skipped), "skipped")

	_, err = admin.ForgetDone(ctx, s, admin.Filter{}, true)
	fmt.Println(err)
	// Output:
	// plan: orders:PO-2 done at 12:20PM
	// <nil> 1 forgotten 0 skipped
	// admin: no prefix (set Filter.All to select every key)
}

func ExamplePurge() {
	clock := fake.NewClock(start)
	s := fake.New(fake.WithClock(clock.Now), fake.WithTTL(time.Hour))
	done(s, "orders:PO-1")
	clock.Advance(2 * time.Hour)
	done(s, "orders:PO-2")

	n, err := admin.Purge(context.Background(), s, 0)
	fmt.Println(n, err, s.Len())
	// Output:
	// 1 <nil> 1
}
