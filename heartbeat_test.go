package idempotency_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// waitExtends blocks until the store has seen n more Extend calls.
func waitExtends(t *testing.T, s *fake.Store, n int) {
	t.Helper()
	want := s.Calls(fake.OpExtend) + n
	deadline := time.Now().Add(10 * time.Second)
	for s.Calls(fake.OpExtend) < want {
		if time.Now().After(deadline) {
			t.Fatalf("no heartbeat: %d Extend calls, want %d", s.Calls(fake.OpExtend), want)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestHeartbeatKeepsWorkThatOutrunsItsLeaseFromBeingReclaimed(t *testing.T) {
	s, clock := newStore(t)
	ctx := t.Context()
	err := idempotency.Lock(ctx, s, "long", func(ctx context.Context) error {
		// Six minutes of work on a one-minute lease, renewed as it goes.
		for range 12 {
			clock.Advance(30 * time.Second)
			waitExtends(t, s, 1)
		}
		if err := idempotency.Lock(ctx, s, "long", func(context.Context) error {
			t.Error("a redelivery took the key from live work")
			return nil
		}); !errors.Is(err, idempotency.ErrInProgress) {
			t.Errorf("redelivery during the work: %v, want ErrInProgress", err)
		}
		return nil
	}, idempotency.WithLease(time.Minute), idempotency.WithHeartbeat(time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if rec, _ := s.Record("long"); rec.State != store.Done || rec.Fence != 1 {
		t.Fatalf("record %+v, want done with fence 1", rec)
	}
}

func TestHeartbeatCancelsTheBodyWhenTheClaimIsLost(t *testing.T) {
	s, clock := newStore(t)
	l, logger := newLogs()
	ctx := t.Context()
	var cause error
	err := idempotency.Lock(ctx, s, "lost", func(ctx context.Context) error {
		// The renewals fail (say the store is unreachable) until the lease
		// lapses and another delivery takes the key.
		for range 3 {
			s.FailNext(fake.OpExtend, errors.New("unavailable"))
		}
		waitExtends(t, s, 3)
		clock.Advance(2 * time.Minute)
		if r, _ := s.Claim(context.Background(), "lost", time.Hour); r.Outcome != store.Won {
			t.Errorf("the takeover: %v", r.Outcome)
		}
		<-ctx.Done()
		cause = context.Cause(ctx)
		return ctx.Err()
	}, idempotency.WithLease(time.Minute), idempotency.WithHeartbeat(time.Millisecond), idempotency.WithLogger(logger))
	if !errors.Is(err, context.Canceled) || !errors.Is(cause, store.ErrLost) {
		t.Fatalf("err = %v, cause = %v; want the body cancelled because the claim was lost", err, cause)
	}
	if len(l.find(t, "WARN", "renewal failed")) < 3 || len(l.find(t, "ERROR", "claim was lost")) != 1 {
		t.Fatalf("logs: %v", l.records(t))
	}
	if rec, _ := s.Record("lost"); rec.Fence != 2 || rec.State != store.Claimed {
		t.Fatalf("record %+v: the new holder's claim must stand", rec)
	}
}

func TestHeartbeatCompletesWithTheRenewedClaim(t *testing.T) {
	// A backend that changes the claim on each renewal (as Datastore's
	// version does) must be completed with the latest one.
	s := fake.New()
	var extended store.Claim
	b := extendingBackend{Store: s, seen: &extended}
	err := idempotency.Lock(t.Context(), b, "k", func(context.Context) error {
		waitExtends(t, s, 2)
		return nil
	}, idempotency.WithHeartbeat(time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if rec, _ := s.Record("k"); rec.State != store.Done {
		t.Fatalf("record %+v", rec)
	}
}

// extendingBackend bumps Rev on every Extend and insists Complete gets the
// latest Rev.
type extendingBackend struct {
	*fake.Store
	seen *store.Claim
}

func (b extendingBackend) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	c, err := b.Store.Extend(ctx, c, lease)
	c.Rev++
	*b.seen = c
	return c, err
}

func (b extendingBackend) Complete(ctx context.Context, c store.Claim) (bool, error) {
	if c.Rev != b.seen.Rev {
		return false, errors.New("completed with a stale claim")
	}
	return b.Store.Complete(ctx, c)
}

func TestHeartbeatIsIgnoredWithAWarningWithoutExtender(t *testing.T) {
	s := fake.New()
	l, logger := newLogs()
	b := backendFunc{claim: s.Claim, complete: s.Complete, release: s.Release}
	if err := idempotency.Lock(t.Context(), b, "k", func(context.Context) error { return nil },
		idempotency.WithHeartbeat(time.Second), idempotency.WithLogger(logger)); err != nil {
		t.Fatal(err)
	}
	if len(l.find(t, "WARN", "WithHeartbeat ignored")) != 1 {
		t.Fatalf("logs: %v", l.records(t))
	}
}

func TestHeartbeatMustBeShorterThanTheLease(t *testing.T) {
	s := fake.New()
	noop := func(context.Context) error { return nil }
	for _, hb := range []time.Duration{-time.Second, time.Minute, 2 * time.Minute} {
		if err := idempotency.Lock(t.Context(), s, "k", noop, idempotency.WithLease(time.Minute), idempotency.WithHeartbeat(hb)); err == nil {
			t.Errorf("heartbeat %v with a 1m lease accepted", hb)
		}
	}
}

// A body that outlives its request (the push deadline passed, or Cloud Run
// cut the request) is still doing the work: the heartbeat must keep its
// claim until the body returns, or a redelivery takes the key once the
// short lease lapses and runs the work a second time beside it.
func TestHeartbeatKeepsRenewingUntilTheBodyReturnsEvenAfterTheRequestEnds(t *testing.T) {
	s, clock := newStore(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var second int
	err := idempotency.Lock(ctx, s, "outlived", func(bctx context.Context) error {
		cancel() // the request ends; this body does not watch its context
		for range 6 {
			clock.Advance(30 * time.Second)
			want := s.Calls(fake.OpExtend) + 1
			for deadline := time.Now().Add(2 * time.Second); s.Calls(fake.OpExtend) < want && time.Now().Before(deadline); {
				time.Sleep(time.Millisecond)
			}
		}
		// Three minutes on, a redelivery arrives.
		if err := idempotency.Lock(t.Context(), s, "outlived", func(context.Context) error {
			second++
			return nil
		}); !errors.Is(err, idempotency.ErrInProgress) {
			t.Errorf("redelivery while the first body still runs: %v, want ErrInProgress", err)
		}
		return nil
	}, idempotency.WithLease(time.Minute), idempotency.WithHeartbeat(time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if second != 0 {
		t.Fatalf("the work ran %d more time(s) while the first body still ran", second)
	}
	if rec, _ := s.Record("outlived"); rec.State != store.Done || rec.Fence != 1 {
		t.Fatalf("record %+v, want done by the first holder (fence 1)", rec)
	}
}
