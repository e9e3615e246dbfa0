package doclocktest

import (
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A Claim whose write applied but whose reply was lost, and whose retries
// outlast the short lease that write stored, finds the record in someone
// else's hands: it cannot tell whether it ever won, so it returns an
// error, not HeldByOther or AlreadyDone (store.Backend's MUST rule).
func claimRetriedPastItsLeaseCannotTellAndFails(t *testing.T, drv h) {
	drv.Emulator(t)
	const lease = time.Minute
	for _, path := range []string{"create", "reclaim"} {
		for _, then := range []string{"held", "done"} {
			t.Run(path+"/"+then, func(t *testing.T) {
				ctx := t.Context()
				a, ra, b, clock := drv.twoOnOneClock(t)
				if path == "reclaim" {
					a.Claim(ctx, "k", lease) // a holder that crashed
					clock.Advance(lease + time.Second)
				}
				ra.LoseNextCommit.Store(true)
				ra.WhileLost = func() {
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
				if ra.Lost.Load() != 1 {
					t.Fatalf("%d replies lost, want 1", ra.Lost.Load())
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
func claimRetriedWithinItsLeaseTellsAndAnswers(t *testing.T, drv h) {
	drv.Emulator(t)
	for _, then := range []string{"held", "done"} {
		t.Run(then, func(t *testing.T) {
			ctx := t.Context()
			a, ra, b, _ := drv.twoOnOneClock(t)
			a.Claim(ctx, "warm-up", time.Minute)
			ra.DropNextCommit.Store(true)
			ra.WhileLost = func() {
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
func claimWhoseRecordExpiredWhileRetryingFails(t *testing.T, drv h) {
	drv.Emulator(t)
	const lease = time.Minute
	for _, then := range []string{"lease_lapsed", "purged"} {
		t.Run(then, func(t *testing.T) {
			ctx := t.Context()
			a, ra, b, clock := drv.twoOnOneClock(t)
			start := clock.Now()
			ra.LoseNextCommit.Store(true)
			ra.WhileLost = func() {
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

func lostCommitResponseIsReaffirmed(t *testing.T, drv h) {
	drv.Emulator(t)
	for _, path := range []string{"create", "reclaim"} {
		t.Run(path, func(t *testing.T) {
			clock := NewClock()
			b, r := drv.onClock(t, clock, Config{})
			ctx := t.Context()
			want := int64(1)
			if path == "reclaim" {
				b.Claim(ctx, "k", time.Minute) // a holder that crashed
				clock.Advance(2 * time.Minute)
				want = 2
			}
			r.LoseNextCommit.Store(true)
			res, err := b.Claim(ctx, "k", time.Minute)
			if r.Lost.Load() != 1 {
				t.Fatalf("%d responses lost, want 1", r.Lost.Load())
			}
			if err != nil || res.Outcome != store.Won || res.Claim.Fence != want {
				t.Fatalf("claim after a lost commit response: %v fence %d %v; want won with fence %d (not locked out, not bumped twice)",
					res.Outcome, res.Claim.Fence, err, want)
			}
			if other, _ := b.Claim(ctx, "k", time.Minute); other.Outcome != store.HeldByOther {
				t.Fatalf("another claim: %v, want held by other", other.Outcome)
			}
			r.LoseNextCommit.Store(true)
			if ok, err := b.Complete(ctx, res.Claim); !ok || err != nil {
				t.Fatalf("complete after a lost commit response: %v %v", ok, err)
			}
			if r.Lost.Load() != 2 {
				t.Fatalf("the complete's response was not lost")
			}
			if again, _ := b.Claim(ctx, "k", time.Minute); again.Outcome != store.AlreadyDone {
				t.Fatalf("after complete: %v", again.Outcome)
			}
		})
	}
}

func init() {
	add(
		testCase{"ClaimRetriedPastItsLeaseCannotTellAndFails", claimRetriedPastItsLeaseCannotTellAndFails},
		testCase{"ClaimRetriedWithinItsLeaseTellsAndAnswers", claimRetriedWithinItsLeaseTellsAndAnswers},
		testCase{"ClaimWhoseRecordExpiredWhileRetryingFails", claimWhoseRecordExpiredWhileRetryingFails},
		testCase{"LostCommitResponseIsReaffirmed", lostCommitResponseIsReaffirmed},
	)
}
