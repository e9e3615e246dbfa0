package datastorelock_test

import (
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
)

// twoOnOneClock returns two backends on one namespace and one fake clock
// (the emulator's replies carry no server time, so both judge by it).
func twoOnOneClock(t *testing.T) (a *datastorelock.Backend, ra *rpcs, b *datastorelock.Backend, clock *fake.Clock) {
	clock = fake.NewClock(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC))
	ns := namespace()
	a, ra = newBackend(t, datastorelock.WithNamespace(ns), datastorelock.WithClock(clock.Now))
	b, _ = newBackend(t, datastorelock.WithNamespace(ns), datastorelock.WithClock(clock.Now))
	return a, ra, b, clock
}

// A Claim whose write applied but whose reply was lost, and whose retries
// outlast the short lease that write stored, finds the record in someone
// else's hands: it cannot tell whether it ever won, so it returns an
// error, not HeldByOther or AlreadyDone (store.Backend's MUST rule).
func TestClaimRetriedPastItsLeaseCannotTellAndFails(t *testing.T) {
	testsvc.Datastore(t)
	const lease = time.Minute
	for _, path := range []string{"create", "reclaim"} {
		for _, then := range []string{"held", "done"} {
			t.Run(path+"/"+then, func(t *testing.T) {
				ctx := t.Context()
				a, ra, b, clock := twoOnOneClock(t)
				if path == "reclaim" {
					a.Claim(ctx, "k", lease) // a holder that crashed
					clock.Advance(lease + time.Second)
				}
				ra.loseNextCommit.Store(true)
				ra.whileLost = func() {
					// The retries take longer than the lease: another
					// instance reclaims the key meanwhile.
					clock.Advance(lease + time.Second)
					r, err := b.Claim(ctx, "k", time.Hour)
					if err != nil || r.Outcome != store.Won {
						t.Errorf("the other instance's claim: %v %v", r.Outcome, err)
						return
					}
					if then == "done" {
						if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
							t.Errorf("the other instance's complete: %v %v", ok, err)
						}
					}
				}
				res, err := a.Claim(ctx, "k", lease)
				if ra.lost.Load() != 1 {
					t.Fatalf("%d replies lost, want 1", ra.lost.Load())
				}
				if err == nil {
					t.Fatalf("claim whose lost write won, then lapsed and was taken over: %v; want an error (it cannot tell)", res.Outcome)
				}
				t.Logf("claim: %v", err)
			})
		}
	}
}

// When the lost write's lease cannot have lapsed by the time the retry
// reads, the retry can tell that the write never landed, and answers.
func TestClaimRetriedWithinItsLeaseTellsAndAnswers(t *testing.T) {
	testsvc.Datastore(t)
	for _, then := range []string{"held", "done"} {
		t.Run(then, func(t *testing.T) {
			ctx := t.Context()
			a, ra, b, _ := twoOnOneClock(t)
			a.Claim(ctx, "warm-up", time.Minute)
			ra.dropNextCommit.Store(true)
			ra.whileLost = func() {
				r, err := b.Claim(ctx, "k", time.Hour)
				if err != nil || r.Outcome != store.Won {
					t.Errorf("the other instance's claim: %v %v", r.Outcome, err)
					return
				}
				if then == "done" {
					b.Complete(ctx, r.Claim)
				}
			}
			want := map[string]store.Outcome{"held": store.HeldByOther, "done": store.AlreadyDone}[then]
			res, err := a.Claim(ctx, "k", time.Minute)
			if err != nil || res.Outcome != want {
				t.Fatalf("claim whose write never arrived, while another took the key: %v %v; want %v", res.Outcome, err, want)
			}
		})
	}
}

// A Claim whose own write landed (its reply lost) and whose retries
// outlast the lease it wrote answers Won with that claim, as the port
// says (same fence, the lease it wrote), when nobody took the key; but
// when the retries also outlast the ttl, and the record was purged and the
// retried insert wrote it again, already expired, it returns an error: the
// record may go at any moment and the fence start again at 1.
func TestClaimWhoseRecordExpiredWhileRetryingFails(t *testing.T) {
	testsvc.Datastore(t)
	const lease = time.Minute
	for _, then := range []string{"lease_lapsed", "purged"} {
		t.Run(then, func(t *testing.T) {
			ctx := t.Context()
			a, ra, b, clock := twoOnOneClock(t)
			start := clock.Now()
			ra.loseNextCommit.Store(true)
			ra.whileLost = func() {
				clock.Advance(lease + time.Second)
				if then == "purged" {
					clock.Advance(a.TTL())
					if n, err := b.PurgeExpired(ctx, 0); n != 1 || err != nil {
						t.Errorf("purge: %d %v", n, err)
					}
				}
			}
			res, err := a.Claim(ctx, "k", lease)
			if then == "lease_lapsed" {
				if err != nil || res.Outcome != store.Won || res.Claim.Fence != 1 || !res.Claim.LeaseExpiry.Equal(start.Add(lease)) {
					t.Fatalf("claim: %v fence %d until %v, %v; want won with fence 1 until %v (the claim it made)",
						res.Outcome, res.Claim.Fence, res.Claim.LeaseExpiry, err, start.Add(lease))
				}
				return
			}
			if err == nil {
				t.Fatalf("claim: %v fence %d lease until %v (now %v); want an error, not an expired record",
					res.Outcome, res.Claim.Fence, res.Claim.LeaseExpiry, clock.Now())
			}
			t.Logf("claim: %v", err)
			// The key is free: the next claim takes it.
			if r, err := b.Claim(ctx, "k", lease); err != nil || r.Outcome != store.Won {
				t.Fatalf("next claim: %v %v, want won", r.Outcome, err)
			}
		})
	}
}

// An Extend whose write landed but whose reply was lost recognises its
// own write on the retry and does not extend a second time.
func TestExtendWithALostReplyExtendsOnce(t *testing.T) {
	testsvc.Datastore(t)
	ctx := t.Context()
	a, ra, b, clock := twoOnOneClock(t)
	r, _ := a.Claim(ctx, "k", time.Minute)
	ra.loseNextCommit.Store(true)
	ra.whileLost = func() { clock.Advance(time.Second) }
	start := clock.Now()
	ext, err := a.Extend(ctx, r.Claim, time.Hour)
	if err != nil || !ext.LeaseExpiry.Equal(start.Add(time.Hour)) {
		t.Fatalf("extend: %v until %v, want until %v (the write that landed, not a second one)", err, ext.LeaseExpiry, start.Add(time.Hour))
	}
	if h, _ := b.Claim(ctx, "k", time.Minute); h.Outcome != store.HeldByOther || !h.Until.Equal(ext.LeaseExpiry) {
		t.Fatalf("claim: %v until %v, want held until %v", h.Outcome, h.Until, ext.LeaseExpiry)
	}
}

// A Complete whose write applied but whose reply was lost, and whose
// retries outlast the ttl, finds the record reclaimed by another: it
// cannot tell whether it completed, so it returns an error, not false.
func TestCompleteRetriedPastItsTTLCannotTellAndFails(t *testing.T) {
	testsvc.Datastore(t)
	ctx := t.Context()
	a, ra, b, clock := twoOnOneClock(t)
	r, _ := a.Claim(ctx, "k", time.Minute)
	ra.loseNextCommit.Store(true)
	ra.whileLost = func() {
		clock.Advance(a.TTL() + time.Second)
		if r, err := b.Claim(ctx, "k", time.Minute); err != nil || r.Outcome != store.Won {
			t.Errorf("the other instance's claim: %v %v", r.Outcome, err)
		}
	}
	ok, err := a.Complete(ctx, r.Claim)
	if err == nil {
		t.Fatalf("complete whose lost write applied, then expired and was reclaimed: %v; want an error (it cannot tell)", ok)
	}
	t.Logf("complete: %v", err)
}

// A Complete whose versioned update misses because the record is gone
// (deleted after its expires-at) reports false, not true.
func TestCompleteOfAPurgedRecordIsFalse(t *testing.T) {
	testsvc.Datastore(t)
	ctx := t.Context()
	clock := fake.NewClock(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC))
	b, _ := newBackend(t, datastorelock.WithClock(clock.Now))
	r, _ := b.Claim(ctx, "k", time.Minute)
	clock.Advance(time.Minute + b.TTL() + time.Second)
	if n, err := b.PurgeExpired(ctx, 0); n != 1 || err != nil {
		t.Fatalf("purge: %d %v", n, err)
	}
	if ok, err := b.Complete(ctx, r.Claim); ok || err != nil {
		t.Fatalf("complete of a purged record: %v %v, want false", ok, err)
	}
	// A fresh record starts at fence 1 again; the old claim, also fence 1,
	// is told apart by its token and cannot complete it.
	fresh, _ := b.Claim(ctx, "k", time.Minute)
	if fresh.Claim.Fence != 1 {
		t.Fatalf("fresh record: fence %d", fresh.Claim.Fence)
	}
	if ok, err := b.Complete(ctx, r.Claim); ok || err != nil {
		t.Fatalf("complete of the old claim over a fresh record with the same fence: %v %v, want false", ok, err)
	}
	if r, _ := b.Claim(ctx, "k", time.Minute); r.Outcome != store.HeldByOther {
		t.Fatalf("fresh record after the old claim's complete: %v, want held by other", r.Outcome)
	}
}
