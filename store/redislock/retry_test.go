package redislock_test

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// The gap between a lost reply and the resend, long enough for another
// caller to act in it on a loaded machine.
const resendGap = 800 * time.Millisecond

// lossRig is a backend whose replies a DropProxy can lose, beside a second
// backend on the same records that talks to the server directly (another
// instance that acts while the first one waits to resend).
type lossRig struct {
	proxy *testsvc.DropProxy
	b     *redislock.Backend // through the proxy
	other *redislock.Backend // same prefix, direct
	raw   *redis.Client      // direct
}

// resender says who resends a command whose reply was lost: the backend
// (its own retry, go-redis told not to) or go-redis (its MaxRetries, the
// backend told not to).
type resender string

const (
	byBackend resender = "backend_resends"
	byDriver  resender = "driver_resends"
)

func newLossRig(t *testing.T, by resender, ttl time.Duration) *lossRig {
	t.Helper()
	addr := testsvc.Redis(t)
	proxy := testsvc.NewDropProxy(t, addr)
	ours := 1
	c := client(t, proxy.Addr(), func(o *redis.Options) {
		o.MaxRetries = -1
		if by == byDriver {
			o.MaxRetries = 1
			o.MinRetryBackoff, o.MaxRetryBackoff = resendGap, resendGap
			ours = 0
		}
	})
	b := newBackend(t, c, redislock.WithTTL(ttl), redislock.WithClaimRetries(ours))
	redislock.SetRetryBackoff(b, resendGap)
	raw := client(t, addr)
	other, err := redislock.New(raw, redislock.WithPrefix(prefixOf(b)), redislock.WithTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
	// Load every script and leave a pooled connection, so that the next
	// reply the proxy sees is the reply of the call under test.
	ctx := t.Context()
	w, err := b.Claim(ctx, "warm-up", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Extend(ctx, w.Claim, time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := b.Release(ctx, w.Claim); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Complete(ctx, w.Claim); err != nil {
		t.Fatal(err)
	}
	return &lossRig{proxy: proxy, b: b, other: other, raw: raw}
}

// loseNextReply arms the proxy and runs meanwhile, once the reply is lost,
// before the resend. The returned func waits for meanwhile to finish.
func (r *lossRig) loseNextReply(t *testing.T, meanwhile func()) (wait func()) {
	t.Helper()
	r.proxy.Armed.Store(true)
	done := make(chan struct{})
	go func() {
		defer close(done)
		deadline := time.Now().Add(10 * time.Second)
		for r.proxy.Dropped.Load() == 0 {
			if time.Now().After(deadline) {
				t.Error("the proxy never dropped a reply")
				return
			}
			time.Sleep(time.Millisecond)
		}
		if meanwhile != nil {
			meanwhile()
		}
	}()
	return func() { <-done }
}

// isDriverError reports whether err wraps the network failure the lost
// reply caused.
func isDriverError(err error) bool {
	var op *net.OpError
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.As(err, &op)
}

// A Claim whose first attempt won and lost its reply, and whose key moved
// on before the resend, must not answer held-by-other or already-done: it
// cannot tell whether it ran the key, so it returns an error (Lock then
// nacks and the redelivery finds out).
func TestClaimResentAfterTheKeyMovedOnIsAnErrorNotAnOutcome(t *testing.T) {
	const lease = 200 * time.Millisecond
	for _, by := range []resender{byBackend, byDriver} {
		for _, tc := range []struct {
			name    string
			moveOn  func(t *testing.T, r *lossRig)
			outcome store.Outcome // what another caller sees afterwards
		}{
			{"reclaimed_by_another", func(t *testing.T, r *lossRig) {
				if _, err := r.other.Claim(t.Context(), "k", time.Minute); err != nil {
					t.Error(err)
				}
			}, store.HeldByOther},
			{"reclaimed_and_completed_by_another", func(t *testing.T, r *lossRig) {
				w, err := r.other.Claim(t.Context(), "k", time.Minute)
				if err != nil || w.Outcome != store.Won {
					t.Errorf("the other's reclaim: %v %v", w.Outcome, err)
					return
				}
				if ok, err := r.other.Complete(t.Context(), w.Claim); !ok || err != nil {
					t.Errorf("the other's complete: %v %v", ok, err)
				}
			}, store.AlreadyDone},
		} {
			t.Run(string(by)+"/"+tc.name, func(t *testing.T) {
				r := newLossRig(t, by, time.Hour)
				wait := r.loseNextReply(t, func() {
					time.Sleep(lease + 50*time.Millisecond) // our lost win lapses
					tc.moveOn(t, r)
				})
				res, err := r.b.Claim(t.Context(), "k", lease)
				wait()
				if err == nil {
					t.Fatalf("resent claim answered %v (fence %d); want an error: its own lost attempt won the key", res.Outcome, res.Claim.Fence)
				}
				if !isDriverError(err) {
					t.Errorf("error %v does not wrap the driver's error", err)
				}
				if got, _ := r.other.Claim(t.Context(), "k", time.Minute); got.Outcome != tc.outcome {
					t.Fatalf("the key afterwards: %v, want %v (the error changed nothing)", got.Outcome, tc.outcome)
				}
				if f, _ := r.raw.HGet(t.Context(), prefixOf(r.b)+"k", "f").Int64(); f != 2 {
					t.Fatalf("stored fence %d, want 2 (our lost win, the other's reclaim)", f)
				}
			})
		}
	}
}

// A resent Claim that finds its own claim after the lease lapsed (nobody
// took the key meanwhile) answers the lost attempt's win unchanged: same
// fence, and the lease expiry that attempt set, even though it has passed.
// The call took effect once, at the lost attempt; renewing the lease on the
// resend would be a second effect, which other callers that saw the first
// lease would contradict (the linearizability check catches it).
func TestClaimResentAfterItsOwnLeaseLapsedIsTheLostAttemptsWin(t *testing.T) {
	const lease = 300 * time.Millisecond
	r := newLossRig(t, byBackend, time.Hour)
	var seen store.Result
	wait := r.loseNextReply(t, func() {
		seen, _ = r.other.Claim(t.Context(), "k", time.Minute)
	})
	before := serverNow(t, r.raw)
	res, err := r.b.Claim(t.Context(), "k", lease)
	wait()
	if err != nil || res.Outcome != store.Won || res.Claim.Fence != 1 {
		t.Fatalf("resent claim: %v fence %d %v; want won, fence 1", res.Outcome, res.Claim.Fence, err)
	}
	if seen.Outcome != store.HeldByOther || !seen.Until.Equal(res.Claim.LeaseExpiry) {
		t.Fatalf("another caller between the attempts saw %v until %v; the resent claim reports lease expiry %v (want the same instant)",
			seen.Outcome, seen.Until, res.Claim.LeaseExpiry)
	}
	if d := res.Claim.LeaseExpiry.Sub(before); d < lease-time.Millisecond || d > lease+resendGap/2 {
		t.Fatalf("lease expiry %v is %v after the call began; want the first attempt's lease", res.Claim.LeaseExpiry, d)
	}
	if ok, err := r.b.Complete(t.Context(), res.Claim); !ok || err != nil {
		t.Fatalf("complete: %v %v", ok, err)
	}
}

// A resent Claim that finds the key free (its own lost win lapsed, was
// reclaimed by another caller and released) must not win it again: the
// call would then have taken two fences (its lost attempt's and the
// resend's), one of them a phantom that nobody holds, which no history of
// single calls explains (the linearizability check caught it). It changes
// nothing and returns an error; the redelivery wins the key.
func TestClaimResentOnAFreedKeyIsAnErrorNotASecondWin(t *testing.T) {
	const lease = 200 * time.Millisecond
	r := newLossRig(t, byBackend, time.Hour)
	wait := r.loseNextReply(t, func() {
		time.Sleep(lease + 50*time.Millisecond)
		w, err := r.other.Claim(t.Context(), "k", time.Minute)
		if err != nil || w.Outcome != store.Won {
			t.Errorf("the other's reclaim: %v %v", w.Outcome, err)
			return
		}
		if err := r.other.Release(t.Context(), w.Claim); err != nil {
			t.Error(err)
		}
	})
	res, err := r.b.Claim(t.Context(), "k", lease)
	wait()
	if err == nil {
		t.Fatalf("resent claim: %v fence %d; want an error (its lost attempt won fence 1, the key is free again at fence 3)", res.Outcome, res.Claim.Fence)
	}
	if !isDriverError(err) {
		t.Errorf("error %v does not wrap the driver's error", err)
	}
	if f, _ := r.raw.HGet(t.Context(), prefixOf(r.b)+"k", "f").Int64(); f != 3 {
		t.Fatalf("stored fence %d, want 3: the resend changed nothing", f)
	}
	if got, _ := r.other.Claim(t.Context(), "k", time.Minute); got.Outcome != store.Won || got.Claim.Fence != 4 {
		t.Fatalf("the redelivery: %v fence %d, want won with fence 4", got.Outcome, got.Claim.Fence)
	}
}

// A Complete that landed and lost its reply, resent after its Done record
// was reaped and another caller created the key afresh (fence 1 again),
// must neither mark the newcomer's claim done nor report false: it cannot
// tell, so it returns an error.
func TestCompleteResentAfterTheKeyWasRecreatedLeavesTheNewcomerAlone(t *testing.T) {
	const ttl = 200 * time.Millisecond
	for _, by := range []resender{byBackend, byDriver} {
		t.Run(string(by), func(t *testing.T) {
			r := newLossRig(t, by, ttl)
			ctx := t.Context()
			mine, err := r.b.Claim(ctx, "k", time.Minute)
			if err != nil || mine.Outcome != store.Won {
				t.Fatal(mine.Outcome, err)
			}
			var newcomer store.Result
			wait := r.loseNextReply(t, func() {
				time.Sleep(ttl + 100*time.Millisecond) // the done record expires and is reaped
				newcomer, _ = r.other.Claim(ctx, "k", time.Minute)
			})
			ok, err := r.b.Complete(ctx, mine.Claim)
			wait()
			if newcomer.Outcome != store.Won || newcomer.Claim.Fence != 1 {
				t.Fatalf("newcomer: %v fence %d, want won with fence 1 (a fresh record)", newcomer.Outcome, newcomer.Claim.Fence)
			}
			if err == nil {
				t.Errorf("resent complete = %v, nil; want an error (its completion landed, the record is gone)", ok)
			} else if !isDriverError(err) {
				t.Errorf("error %v does not wrap the driver's error", err)
			}
			if s, _ := r.raw.HGet(ctx, prefixOf(r.b)+"k", "s").Result(); s != "c" {
				t.Fatalf("the newcomer's record is %q, want still claimed", s)
			}
			if ok, err := r.other.Complete(ctx, newcomer.Claim); !ok || err != nil {
				t.Fatalf("the newcomer's complete: %v %v", ok, err)
			}
		})
	}
}

// A Complete whose reply was lost and whose record did not move reports
// true on the resend.
func TestCompleteResentFindsItsOwnCompletion(t *testing.T) {
	r := newLossRig(t, byBackend, time.Hour)
	ctx := t.Context()
	mine, _ := r.b.Claim(ctx, "k", time.Minute)
	wait := r.loseNextReply(t, nil)
	ok, err := r.b.Complete(ctx, mine.Claim)
	wait()
	if !ok || err != nil {
		t.Fatalf("resent complete: %v %v; want true", ok, err)
	}
	if got, _ := r.other.Claim(ctx, "k", time.Minute); got.Outcome != store.AlreadyDone {
		t.Fatalf("after: %v, want already done", got.Outcome)
	}
}

// A Release that landed and lost its reply, resent after the record was
// reaped and created afresh by another caller, must not release the
// newcomer's claim (same fence 1, another claim).
func TestReleaseResentAfterTheKeyWasRecreatedLeavesTheNewcomerAlone(t *testing.T) {
	const ttl = 200 * time.Millisecond
	for _, by := range []resender{byBackend, byDriver} {
		t.Run(string(by), func(t *testing.T) {
			r := newLossRig(t, by, ttl)
			ctx := t.Context()
			mine, _ := r.b.Claim(ctx, "k", time.Minute)
			var newcomer store.Result
			wait := r.loseNextReply(t, func() {
				time.Sleep(ttl + 100*time.Millisecond)
				newcomer, _ = r.other.Claim(ctx, "k", time.Minute)
			})
			err := r.b.Release(ctx, mine.Claim)
			wait()
			if err != nil && !isDriverError(err) {
				t.Errorf("error %v does not wrap the driver's error", err)
			}
			if newcomer.Outcome != store.Won || newcomer.Claim.Fence != 1 {
				t.Fatalf("newcomer: %v fence %d, want won with fence 1", newcomer.Outcome, newcomer.Claim.Fence)
			}
			if got, _ := r.other.Claim(ctx, "k", time.Minute); got.Outcome != store.HeldByOther {
				t.Fatalf("a third caller: %v; want held by other (the newcomer's claim was released)", got.Outcome)
			}
			if ok, err := r.other.Complete(ctx, newcomer.Claim); !ok || err != nil {
				t.Fatalf("the newcomer's complete: %v %v; want true", ok, err)
			}
		})
	}
}

// An Extend resent after the record was reaped and created afresh must not
// renew the newcomer's lease for the old holder: the old holder's claim is
// lost, and must hear so.
func TestExtendResentAfterTheKeyWasRecreatedIsLost(t *testing.T) {
	const ttl = 200 * time.Millisecond
	for _, by := range []resender{byBackend, byDriver} {
		t.Run(string(by), func(t *testing.T) {
			r := newLossRig(t, by, ttl)
			ctx := t.Context()
			mine, _ := r.b.Claim(ctx, "k", time.Minute)
			var newcomer store.Result
			wait := r.loseNextReply(t, func() {
				// Our extension (a 50ms lease) lapses, then its ttl.
				time.Sleep(50*time.Millisecond + ttl + 100*time.Millisecond)
				newcomer, _ = r.other.Claim(ctx, "k", time.Minute)
			})
			_, err := r.b.Extend(ctx, mine.Claim, 50*time.Millisecond)
			wait()
			if newcomer.Outcome != store.Won || newcomer.Claim.Fence != 1 {
				t.Fatalf("newcomer: %v fence %d, want won with fence 1", newcomer.Outcome, newcomer.Claim.Fence)
			}
			if err == nil {
				t.Fatal("resent extend succeeded on the newcomer's record; want ErrLost (or the driver's error)")
			}
			if !errors.Is(err, store.ErrLost) && !isDriverError(err) {
				t.Errorf("error %v is neither ErrLost nor the driver's", err)
			}
			l, _ := r.raw.HGet(ctx, prefixOf(r.b)+"k", "l").Int64()
			if got := time.UnixMilli(l); !got.Equal(newcomer.Claim.LeaseExpiry) {
				t.Fatalf("the newcomer's lease expiry moved from %v to %v", newcomer.Claim.LeaseExpiry, got)
			}
		})
	}
}

// The same hazard without any lost reply: a holder that outlives lease +
// ttl (a misconfiguration, but possible) finds its record reaped and
// created afresh at fence 1 by another caller. Its fence matches; its
// claim is not that record's, and it can change nothing.
func TestAHolderOutlivingItsRecordCannotTouchTheNextOne(t *testing.T) {
	const ttl = 100 * time.Millisecond
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c, redislock.WithTTL(ttl))
	ctx := t.Context()
	for _, op := range []string{"complete", "release", "extend"} {
		t.Run(op, func(t *testing.T) {
			k := "k-" + op
			old, err := b.Claim(ctx, k, 10*time.Millisecond)
			if err != nil || old.Outcome != store.Won {
				t.Fatal(old.Outcome, err)
			}
			time.Sleep(10*time.Millisecond + ttl + 100*time.Millisecond)
			next, err := b.Claim(ctx, k, time.Minute)
			if err != nil || next.Outcome != store.Won || next.Claim.Fence != 1 {
				t.Fatalf("next: %v fence %d %v; want won, fence 1 (a fresh record)", next.Outcome, next.Claim.Fence, err)
			}
			switch op {
			case "complete":
				if ok, err := b.Complete(ctx, old.Claim); ok || err != nil {
					t.Fatalf("the old holder's complete: %v %v; want false", ok, err)
				}
			case "release":
				if err := b.Release(ctx, old.Claim); err != nil {
					t.Fatal(err)
				}
			case "extend":
				if _, err := b.Extend(ctx, old.Claim, time.Hour); !errors.Is(err, store.ErrLost) {
					t.Fatalf("the old holder's extend: %v; want ErrLost", err)
				}
				l, _ := c.HGet(ctx, prefixOf(b)+k, "l").Int64()
				if !time.UnixMilli(l).Equal(next.Claim.LeaseExpiry) {
					t.Fatalf("the next holder's lease moved to %v", time.UnixMilli(l))
				}
			}
			if got, _ := b.Claim(ctx, k, time.Minute); got.Outcome != store.HeldByOther {
				t.Fatalf("a third caller: %v; want held by other", got.Outcome)
			}
			if ok, err := b.Complete(ctx, next.Claim); !ok || err != nil {
				t.Fatalf("the next holder's complete: %v %v", ok, err)
			}
		})
	}
}

// scriptRuns reads how many EVALSHA and EVAL commands the server behind c
// has run.
func scriptRuns(t *testing.T, c *redis.Client) int64 {
	t.Helper()
	info, err := c.Info(t.Context(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, line := range strings.Split(info, "\n") {
		for _, name := range []string{"cmdstat_evalsha:calls=", "cmdstat_eval:calls="} {
			if rest, ok := strings.CutPrefix(line, name); ok {
				var calls int64
				fmt.Sscanf(rest, "%d", &calls)
				n += calls
			}
		}
	}
	return n
}

// Extend is not resent after a lost reply: a resend would renew the lease
// a second time, from a later instant, after other callers had seen the
// first renewal (one call, two effects). The heartbeat tries again at its
// next beat, as a call of its own.
func TestExtendIsNotResentAfterALostReply(t *testing.T) {
	srv := testsvc.StartRedis(t)
	proxy := testsvc.NewDropProxy(t, srv.Addr)
	c := client(t, proxy.Addr(), func(o *redis.Options) { o.MaxRetries = 5 })
	b := newBackend(t, c, redislock.WithClaimRetries(2))
	direct := client(t, srv.Addr)
	ctx := t.Context()
	r, err := b.Claim(ctx, "k", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Extend(ctx, r.Claim, time.Minute); err != nil { // loads the script
		t.Fatal(err)
	}
	before := scriptRuns(t, direct)
	proxy.Armed.Store(true)
	_, err = b.Extend(ctx, r.Claim, 2*time.Minute)
	if ran := scriptRuns(t, direct) - before; ran != 1 {
		t.Fatalf("extend ran %d times after a lost reply, want 1", ran)
	}
	if err == nil || !isDriverError(err) {
		t.Fatalf("extend with a lost reply: %v; want the driver's error", err)
	}
	// The next beat renews as usual.
	if _, err := b.Extend(ctx, r.Claim, time.Minute); err != nil {
		t.Fatalf("next extend: %v", err)
	}
}
