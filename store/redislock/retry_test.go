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

// lossRig is a backend whose replies a DropProxy can lose, beside a second
// backend on the same records that talks to the server directly (another
// instance that acts while the first one waits to resend).
type lossRig struct {
	by    resender
	proxy *testsvc.DropProxy
	b     *redislock.Backend // through the proxy
	other *redislock.Backend // same prefix, direct
	raw   *redis.Client      // direct
}

// resender says who may resend a command whose reply was lost: the backend
// (its own retry, go-redis told not to) or go-redis (its MaxRetries, the
// backend's retries off), which the backend forbids for its scripts.
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
			ours = 0
		}
	})
	b := newBackend(t, c, redislock.WithTTL(ttl), redislock.WithRetries(ours))
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
	return &lossRig{by: by, proxy: proxy, b: b, other: other, raw: raw}
}

// loseNextReply arms the proxy to lose the next reply of the call under
// test and runs meanwhile once: in the gap between the lost reply and the
// backend's resend (called by the backend, after its backoff), or, when
// the call makes no resend, once the call has returned. The returned func
// must be called after the call; it reports whether the call resent.
func (r *lossRig) loseNextReply(t *testing.T, meanwhile func()) (wait func() (resent bool)) {
	t.Helper()
	done, resent := false, false
	run := func() {
		if done {
			return
		}
		done = true
		if r.proxy.Dropped.Load() == 0 {
			t.Error("the proxy dropped no reply")
		}
		if meanwhile != nil {
			meanwhile()
		}
	}
	redislock.OnResend(r.b, func(int) { resent = resent || !done; run() })
	r.proxy.Armed.Store(true)
	return func() bool {
		redislock.OnResend(r.b, nil)
		run()
		return resent
	}
}

// wantResent fails t unless the call resent exactly when want says.
func wantResent(t *testing.T, resent, want bool) {
	t.Helper()
	if resent != want {
		t.Fatalf("the call resent after its lost reply: %v, want %v", resent, want)
	}
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
				wantResent(t, wait(), by == byBackend)
				if err == nil {
					t.Fatalf("resent claim answered %v (fence %d); want an error: its own lost attempt won the key", res.Outcome, res.Claim.Fence)
				}
				if !isDriverError(err) {
					t.Errorf("error %v does not wrap the driver's error", err)
				}
				if got, _ := r.other.Claim(t.Context(), "k", time.Minute); got.Outcome != tc.outcome {
					t.Fatalf("the key afterwards: %v, want %v (the error changed nothing)", got.Outcome, tc.outcome)
				}
				if f := readRecord(t, r.raw, prefixOf(r.b)+"k").Fence; f != 2 {
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
	var resentAt time.Time
	wait := r.loseNextReply(t, func() {
		seen, _ = r.other.Claim(t.Context(), "k", time.Minute)
		time.Sleep(lease + 50*time.Millisecond) // our lost win lapses
		resentAt = serverNow(t, r.raw)
	})
	before := serverNow(t, r.raw)
	res, err := r.b.Claim(t.Context(), "k", lease)
	wantResent(t, wait(), true)
	if err != nil || res.Outcome != store.Won || res.Claim.Fence != 1 {
		t.Fatalf("resent claim: %v fence %d %v; want won, fence 1", res.Outcome, res.Claim.Fence, err)
	}
	if seen.Outcome != store.HeldByOther || !seen.Until.Equal(res.Claim.LeaseExpiry) {
		t.Fatalf("another caller between the attempts saw %v until %v; the resent claim reports lease expiry %v (want the same instant)",
			seen.Outcome, seen.Until, res.Claim.LeaseExpiry)
	}
	// The lost attempt's lease: set after the call began, lapsed before
	// the resend (a lease renewed by the resend would end after
	// resentAt + lease).
	if d := res.Claim.LeaseExpiry.Sub(before); d < lease-time.Millisecond || !res.Claim.LeaseExpiry.Before(resentAt) {
		t.Fatalf("lease expiry %v is %v after the call began and %v before the resend; want the first attempt's lease, lapsed",
			res.Claim.LeaseExpiry, d, resentAt.Sub(res.Claim.LeaseExpiry))
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
	wantResent(t, wait(), true)
	if err == nil {
		t.Fatalf("resent claim: %v fence %d; want an error (its lost attempt won fence 1, the key is free again at fence 3)", res.Outcome, res.Claim.Fence)
	}
	if !isDriverError(err) {
		t.Errorf("error %v does not wrap the driver's error", err)
	}
	if f := readRecord(t, r.raw, prefixOf(r.b)+"k").Fence; f != 3 {
		t.Fatalf("stored fence %d, want 3: the resend changed nothing", f)
	}
	if got, _ := r.other.Claim(t.Context(), "k", time.Minute); got.Outcome != store.Won || got.Claim.Fence != 4 {
		t.Fatalf("the redelivery: %v fence %d, want won with fence 4", got.Outcome, got.Claim.Fence)
	}
}

// recreatedBeforeTheResend claims "k" on a lossRig with the given ttl, then
// calls op on that claim with its reply lost; before the resend (or, with
// none, after op returns) it waits out the claim's lease (lapse, 0 for one
// that never lapses before op) and ttl, so that Redis deletes the record,
// and has another caller create "k" afresh. It returns the rig, whether op
// resent, the newcomer's claim (which won fence 1) and op's error.
func recreatedBeforeTheResend(t *testing.T, by resender, ttl, lapse time.Duration, op func(r *lossRig, mine store.Claim) error) (r *lossRig, resent bool, newcomer store.Claim, err error) {
	t.Helper()
	r = newLossRig(t, by, ttl)
	ctx := t.Context()
	mine, err := r.b.Claim(ctx, "k", time.Minute)
	if err != nil || mine.Outcome != store.Won {
		t.Fatal(mine.Outcome, err)
	}
	var fresh store.Result
	wait := r.loseNextReply(t, func() {
		time.Sleep(lapse + ttl + 100*time.Millisecond) // the record expires and is reaped
		fresh, _ = r.other.Claim(ctx, "k", time.Minute)
	})
	err = op(r, mine.Claim)
	resent = wait()
	if fresh.Outcome != store.Won || fresh.Claim.Fence != 1 {
		t.Fatalf("newcomer: %v fence %d, want won with fence 1 (a fresh record)", fresh.Outcome, fresh.Claim.Fence)
	}
	return r, resent, fresh.Claim, err
}

// A Complete that landed and lost its reply, resent after its Done record
// was reaped and another caller created the key afresh (fence 1 again),
// must neither mark the newcomer's claim done nor report false: it cannot
// tell, so it returns an error.
func TestCompleteResentAfterTheKeyWasRecreatedLeavesTheNewcomerAlone(t *testing.T) {
	const ttl = 200 * time.Millisecond
	for _, by := range []resender{byBackend, byDriver} {
		t.Run(string(by), func(t *testing.T) {
			var ok bool
			r, resent, newcomer, err := recreatedBeforeTheResend(t, by, ttl, 0, func(r *lossRig, mine store.Claim) (err error) {
				ok, err = r.b.Complete(t.Context(), mine)
				return err
			})
			wantResent(t, resent, by == byBackend)
			if err == nil {
				t.Errorf("resent complete = %v, nil; want an error (its completion landed, the record is gone)", ok)
			} else if !isDriverError(err) {
				t.Errorf("error %v does not wrap the driver's error", err)
			}
			if s := readRecord(t, r.raw, prefixOf(r.b)+"k").State; s != "c" {
				t.Fatalf("the newcomer's record is %q, want still claimed", s)
			}
			if ok, err := r.other.Complete(t.Context(), newcomer); !ok || err != nil {
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
	wantResent(t, wait(), true)
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
			r, resent, newcomer, err := recreatedBeforeTheResend(t, by, ttl, 0, func(r *lossRig, mine store.Claim) error {
				return r.b.Release(t.Context(), mine)
			})
			wantResent(t, resent, by == byBackend)
			if err != nil && !isDriverError(err) {
				t.Errorf("error %v does not wrap the driver's error", err)
			}
			if got, _ := r.other.Claim(t.Context(), "k", time.Minute); got.Outcome != store.HeldByOther {
				t.Fatalf("a third caller: %v; want held by other (the newcomer's claim was released)", got.Outcome)
			}
			if ok, err := r.other.Complete(t.Context(), newcomer); !ok || err != nil {
				t.Fatalf("the newcomer's complete: %v %v; want true", ok, err)
			}
		})
	}
}

// An Extend whose reply was lost is not resent (see
// TestExtendIsNotResentAfterALostReply); neither it nor a driver's resend
// after the record was reaped and created afresh may renew the newcomer's
// lease for the old holder: the old holder's claim is lost, and must hear
// so.
func TestExtendResentAfterTheKeyWasRecreatedIsLost(t *testing.T) {
	const ttl = 200 * time.Millisecond
	const lease = 50 * time.Millisecond // the extension's, which lapses before the ttl
	for _, by := range []resender{byBackend, byDriver} {
		t.Run(string(by), func(t *testing.T) {
			r, resent, newcomer, err := recreatedBeforeTheResend(t, by, ttl, lease, func(r *lossRig, mine store.Claim) error {
				_, err := r.b.Extend(t.Context(), mine, lease)
				return err
			})
			wantResent(t, resent, false)
			if err == nil {
				t.Fatal("resent extend succeeded on the newcomer's record; want ErrLost (or the driver's error)")
			}
			if !errors.Is(err, store.ErrLost) && !isDriverError(err) {
				t.Errorf("error %v is neither ErrLost nor the driver's", err)
			}
			l := readRecord(t, r.raw, prefixOf(r.b)+"k").At
			if got := time.UnixMilli(l); !got.Equal(newcomer.LeaseExpiry) {
				t.Fatalf("the newcomer's lease expiry moved from %v to %v", newcomer.LeaseExpiry, got)
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
	b := newBackend(t, c, redislock.WithRetries(2))
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

// A Claim whose winning reply was lost is resent and re-affirmed: won,
// with the fence it took (not a second one), whatever the client's own
// MaxRetries.
func TestLostClaimReplyIsReaffirmedNotLockedOut(t *testing.T) {
	addr := testsvc.Redis(t)
	for _, tc := range []struct {
		name        string
		clientRetry int // go-redis MaxRetries; -1 disables its own retries
		ours        int
	}{
		{"backend retries", -1, 2},
		// go-redis's own retries stay off for the scripts (see
		// TestGoRedisNeverResendsAScript): the backend resends.
		{"backend retries, client MaxRetries 3", 3, 2},
	} {
		for _, path := range []string{"create", "reclaim"} {
			t.Run(tc.name+"/"+path, func(t *testing.T) {
				proxy := testsvc.NewDropProxy(t, addr)
				c := client(t, proxy.Addr(), func(o *redis.Options) { o.MaxRetries = tc.clientRetry })
				b := newBackend(t, c, redislock.WithRetries(tc.ours))
				ctx := t.Context()
				wantFence := int64(1)
				if path == "reclaim" {
					// A crashed holder's record, lease lapsed.
					if r, err := b.Claim(ctx, "k", time.Millisecond); err != nil || r.Outcome != store.Won {
						t.Fatal(r, err)
					}
					time.Sleep(5 * time.Millisecond)
					wantFence = 2
				} else if _, err := b.Claim(ctx, "warm-up", time.Minute); err != nil { // load the scripts
					t.Fatal(err)
				}

				proxy.Armed.Store(true)
				r, err := b.Claim(ctx, "k", time.Minute)
				if proxy.Dropped.Load() != 1 {
					t.Fatalf("the proxy dropped %d replies, want 1", proxy.Dropped.Load())
				}
				if err != nil || r.Outcome != store.Won || r.Claim.Fence != wantFence {
					t.Fatalf("retried claim: %v fence %d err %v; want won, fence %d (re-affirmed, not bumped twice)",
						r.Outcome, r.Claim.Fence, err, wantFence)
				}
				if tok := readRecord(t, c, prefixOf(b)+"k").Token; tok != r.Claim.Token {
					t.Fatalf("stored token %q, want the claim's %q", tok, r.Claim.Token)
				}
				if other, _ := b.Claim(ctx, "k", time.Minute); other.Outcome != store.HeldByOther {
					t.Fatalf("another delivery: %v, want held by other", other.Outcome)
				}
				if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
					t.Fatalf("complete of the re-affirmed claim: %v %v", ok, err)
				}
			})
		}
	}
}

// go-redis resends a command after a network error (MaxRetries), without
// the backend knowing that the reply it then gets is a resend's. The
// backend turns that off for its scripts: with its own resends off, a lost
// reply is an error after exactly one run of the script, whatever the
// client's MaxRetries.
func TestGoRedisNeverResendsAScript(t *testing.T) {
	srv := testsvc.StartRedis(t)
	proxy := testsvc.NewDropProxy(t, srv.Addr)
	c := client(t, proxy.Addr(), func(o *redis.Options) { o.MaxRetries = 5 })
	b := newBackend(t, c, redislock.WithRetries(0))
	ctx := t.Context()
	direct := client(t, srv.Addr)
	scripts := func() int64 { return scriptRuns(t, direct) }
	r, err := b.Claim(ctx, "k", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	// Load every script, so that the reply lost is the script's, not a
	// NOSCRIPT.
	b.Extend(ctx, r.Claim, time.Minute)
	b.Release(ctx, store.Claim{Key: "k", Fence: 99})
	b.Complete(ctx, store.Claim{Key: "k", Fence: 99})
	for _, op := range ops(b, r.Claim) {
		before := scripts()
		c.Ping(ctx) // a pooled connection, so the reply lost is the script's, not a handshake's
		proxy.Armed.Store(true)
		err := op.call(ctx)
		if ran := scripts() - before; ran != 1 {
			t.Errorf("%s: the script ran %d times, want 1 (no resend by go-redis)", op.name, ran)
		}
		if err == nil {
			t.Errorf("%s: no error after a lost reply and no resend", op.name)
		}
	}
}

func TestALostReplyWithNoRetryIsAnErrorNotHeldByOther(t *testing.T) {
	proxy := testsvc.NewDropProxy(t, testsvc.Redis(t))
	c := client(t, proxy.Addr(), func(o *redis.Options) { o.MaxRetries = -1 })
	b := newBackend(t, c, redislock.WithRetries(0))
	ctx := t.Context()
	b.Claim(ctx, "warm-up", time.Minute)
	proxy.Armed.Store(true)
	r, err := b.Claim(ctx, "k", time.Minute)
	if err == nil || !strings.Contains(err.Error(), "outcome unknown") {
		t.Fatalf("claim whose reply was lost: %v %v; want an error saying the outcome is unknown", r.Outcome, err)
	}
}

// WithRetries(n) covers all four operations: after attempts that surely
// did not run (here every dial is refused) each one sends n+1 times, and
// waits between attempts at least the lower bound of the jittered backoff
// (10ms, 20ms, 40ms, ...: half of 20ms doubled per attempt); the error
// wraps the last attempt's.
func TestWithRetriesResendsEveryOperationNTimesWithBackoff(t *testing.T) {
	port, err := testsvc.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	c := client(t, fmt.Sprintf("127.0.0.1:%d", port), oneDial)
	cl := store.Claim{Key: "k", Fence: 1, Token: "t"}
	for _, n := range []int{0, 1, 3} {
		b := newBackend(t, c, redislock.WithRetries(n))
		for _, op := range ops(b, cl) {
			t.Run(fmt.Sprintf("%s/retries=%d", op.name, n), func(t *testing.T) {
				var gaps []time.Duration
				last := time.Now()
				redislock.OnResend(b, func(attempt int) {
					if attempt != len(gaps)+1 {
						t.Errorf("resend numbered %d after %d resends", attempt, len(gaps))
					}
					gaps = append(gaps, time.Since(last))
					last = time.Now()
				})
				err := op.call(t.Context())
				if len(gaps) != n {
					t.Fatalf("%d resends, want %d", len(gaps), n)
				}
				var op *net.OpError
				if !errors.As(err, &op) || op.Op != "dial" {
					t.Fatalf("error %v does not wrap the refused dial", err)
				}
				for i, g := range gaps {
					if low := (20 * time.Millisecond << i) / 2; g < low {
						t.Errorf("resend %d came %v after the previous attempt began, under the backoff's lower bound %v", i+1, g, low)
					}
				}
			})
		}
	}
}
