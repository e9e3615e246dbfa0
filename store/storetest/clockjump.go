package storetest

import (
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// JumpHarness is a backend on a server whose clock the suite can move while
// the client's clock stays: the cases about a server clock that jumps run
// on it (see Harness.ServerClock).
//
// A backend that judges time by a server's clock (Redis TIME, a database's
// now(), the timestamps a service's replies carry) meets such a jump when
// the server's clock is stepped, or when its own view of the server's time
// goes stale (a client whose monotonic clock stopped, a suspended VM). The
// port's rules hold on the server's clock all the same: a lease or a ttl
// the backend reports runs from the server's now, a live lease stays held,
// a done key stays done.
type JumpHarness struct {
	// Harness is the backend under test and its time, as for Run: TTL,
	// Step, Advance, Now. Now reads the server's clock, jumps included
	// (with Advance, the clock Advance moves; without it, this machine's
	// clock plus every jump so far). Its ServerClock is not used.
	Harness

	// Jump moves the server's clock by d at once, as a step of its system
	// clock would: ahead when d > 0, behind when d < 0. The client's clock
	// stays where it was, and so does anything the backend estimated of the
	// server's time before the jump. Harness.Now moves by d with it.
	// Required. The suite jumps by more than a lease and more than a ttl.
	Jump func(d time.Duration)
}

// serverClock returns the JumpHarness for a subtest of a case about a
// server clock that jumps, or skips the case without Harness.ServerClock.
func (e *env) serverClock() func(t *testing.T) (*env, func(d time.Duration)) {
	e.t.Helper()
	if e.h.ServerClock == nil {
		e.t.Skip("Harness.ServerClock is nil: leases and ttls across a jump of the server's clock are not checked; " +
			"every backend that judges time by a server's clock should provide it")
	}
	return func(t *testing.T) (*env, func(d time.Duration)) {
		t.Helper()
		jh := e.h.ServerClock(t)
		if jh.Jump == nil {
			t.Fatal("storetest: JumpHarness.Jump is nil")
		}
		je := newEnv(t, jh.Harness)
		jump := func(d time.Duration) {
			t.Helper()
			before, real := je.h.Now(), time.Now()
			jh.Jump(d)
			moved := je.h.Now().Sub(before)
			// Without Advance, real time goes by while the server's clock
			// is moved (a loaded machine can take a while): allow it.
			slack := tolerance
			if je.h.Advance == nil {
				slack += time.Since(real)
			}
			if moved < d-tolerance || moved > d+slack {
				t.Fatalf("storetest: JumpHarness.Now moved by %v across Jump(%v); it must read the server's clock, jumps included", moved, d)
			}
			t.Logf("the server's clock jumped by %v, to %v; the client's clock stayed", d, je.h.Now().Format(time.RFC3339Nano))
		}
		return je, jump
	}
}

// eachJump runs check twice, as subtests "ahead" and "behind", each on a
// JumpHarness of its own: after a call that gives a backend which
// estimates the server's time something to estimate from, the server's
// clock jumps by far more than a lease and a ttl, ahead of the client's
// estimate, then (in the other subtest) behind it.
func eachJump(t *testing.T, e *env, check func(t *testing.T, e *env, jump func())) {
	open := e.serverClock()
	for _, dir := range []struct {
		name string
		sign time.Duration
	}{{"ahead", 1}, {"behind", -1}} {
		t.Run(dir.name, func(t *testing.T) {
			je, jump := open(t)
			d := dir.sign * 2 * (je.long() + je.h.TTL)
			je.warmUp()
			check(t, je, func() { jump(d) })
		})
	}
}

// attempts is how many calls the clock-jump cases make before they give
// up on a backend that answers every one with an error. An error (outcome
// unknown) is a legal answer right after a jump, for example from a
// backend that finds its estimate of the server's time misplaced; it is
// not one for ever.
const attempts = 3

// warmUp makes the backend's first calls, before any jump: a claim and
// its completion on a key of their own, so that a backend which estimates
// the server's time has an estimate. A call may fail on a loaded machine
// (a connection still being made); the next one is tried.
func (e *env) warmUp() {
	e.t.Helper()
	for range attempts {
		k := e.key()
		r, err := e.h.Backend.Claim(e.ctx, k, e.long())
		if err != nil {
			e.t.Logf("warm-up Claim(%q): %v (retrying)", k, err)
			continue
		}
		if r.Outcome != store.Won {
			e.t.Fatalf("warm-up Claim(%q) of a fresh key: %v, want won", k, r.Outcome)
		}
		e.retries("warm-up Complete", func() error { _, err := e.h.Backend.Complete(e.ctx, r.Claim); return err })
		return
	}
	e.t.Fatalf("every warm-up Claim failed (%d tries)", attempts)
}

// tryClaim claims key, and reports false when the call failed (outcome
// unknown), which it logs.
func (e *env) tryClaim(key string, lease time.Duration) (store.Result, time.Time, time.Time, bool) {
	e.t.Helper()
	before := e.h.Now()
	r, err := e.h.Backend.Claim(e.ctx, key, lease)
	after := e.h.Now()
	if err != nil {
		e.t.Logf("Claim(%q) after the jump: %v (outcome unknown; allowed)", key, err)
		return r, before, after, false
	}
	return r, before, after, true
}

// claimFresh wins a claim on a fresh key, trying another fresh key after
// an error, and returns it with the window of the call that won it.
func (e *env) claimFresh(lease time.Duration) (store.Claim, time.Time, time.Time) {
	e.t.Helper()
	for range attempts {
		k := e.key()
		r, before, after, ok := e.tryClaim(k, lease)
		if !ok {
			continue
		}
		if r.Outcome != store.Won {
			e.t.Fatalf("Claim(%q) of a fresh key after the jump: %v, want won", k, r.Outcome)
		}
		return r.Claim, before, after
	}
	e.t.Fatalf("every Claim of a fresh key after the jump failed (%d tries)", attempts)
	return store.Claim{}, time.Time{}, time.Time{}
}

// claimAgain claims key until a call answers, and returns that answer with
// its window.
func (e *env) claimAgain(key string, lease time.Duration) (store.Result, time.Time, time.Time) {
	e.t.Helper()
	for range attempts {
		if r, before, after, ok := e.tryClaim(key, lease); ok {
			return r, before, after
		}
	}
	e.t.Fatalf("every Claim(%q) after the jump failed (%d tries)", key, attempts)
	return store.Result{}, time.Time{}, time.Time{}
}

// completeAgain completes c until a call answers true, and returns when the
// first call started (no completion took effect before it) and when the
// answering one returned.
func (e *env) completeAgain(c store.Claim) (before, after time.Time) {
	e.t.Helper()
	before = e.h.Now()
	for range attempts {
		ok, err := e.h.Backend.Complete(e.ctx, c)
		if err != nil {
			e.t.Logf("Complete(%q, fence %d) after the jump: %v (outcome unknown; allowed)", c.Key, c.Fence, err)
			continue
		}
		if !ok {
			e.t.Fatalf("Complete(%q, fence %d) of the current claim after the jump = false, want true", c.Key, c.Fence)
		}
		e.done[c.Key] = completion{c.Fence, before}
		return before, e.h.Now()
	}
	e.t.Fatalf("every Complete(%q) after the jump failed (%d tries)", c.Key, attempts)
	return
}

// jumpThenClaim: a claim won after the server's clock jumped holds the key
// for its lease, by the server's new time: a second Claim is held by the
// first, never won beside it, and the lease the winner was told runs from
// the server's now, not from an estimate made before the jump.
func jumpThenClaim(t *testing.T, e *env) {
	eachJump(t, e, func(t *testing.T, e *env, jump func()) {
		jump()
		lease := e.long()
		c, before, after := e.claimFresh(lease)
		r, from, _ := e.claimAgain(c.Key, lease)
		if r.Outcome == store.Won {
			t.Fatalf("two holders: fence %d won with a lease until %v (%v from the server's now when it was won), "+
				"and a second Claim at %v (the server's time) won fence %d beside it",
				c.Fence, c.LeaseExpiry, c.LeaseExpiry.Sub(before).Round(time.Millisecond), from, r.Claim.Fence)
		}
		if r.Outcome != store.HeldByOther {
			t.Fatalf("second Claim during the lease: %v, want held by other", r.Outcome)
		}
		if !r.Until.IsZero() && !sameInstant(r.Until, c.LeaseExpiry) {
			t.Errorf("HeldByOther.Until = %v, want the holder's lease expiry %v", r.Until, c.LeaseExpiry)
		}
		// The lease runs from the server's now, not from a stale estimate.
		e.within("Claim.LeaseExpiry after the jump", c.LeaseExpiry, before.Add(lease), after.Add(lease))
		e.pass(e.short())
		if r, _, _ := e.claimAgain(c.Key, e.short()); r.Outcome != store.HeldByOther {
			t.Fatalf("Claim a Step into the lease: %v, want held by other", r.Outcome)
		}
		e.completeAgain(c)
		e.expect(c.Key, store.AlreadyDone)
	})
}

// jumpThenComplete: a key completed after the server's clock jumped stays
// done for the ttl from its completion, by the server's new time, and not
// a nanosecond longer: a key claimed after the jump, and one claimed before
// it (its holder completes across the jump).
func jumpThenComplete(t *testing.T, e *env) {
	eachJump(t, e, func(t *testing.T, e *env, jump func()) {
		early := e.won(e.key(), e.long())
		jump()
		// The claim's own lease is the other cases' business. Both
		// completions follow the jump at once, while whatever the backend
		// estimated of the server's time before it is still recent.
		c, _, _ := e.claimFresh(e.long())
		eBefore, eAfter := e.completeAgain(early)
		before, after := e.completeAgain(c)
		for _, k := range []struct {
			what          string
			c             store.Claim
			before, after time.Time
		}{{"claimed before the jump", early, eBefore, eAfter}, {"claimed after the jump", c, before, after}} {
			r := e.claim(k.c.Key, e.long())
			if r.Outcome == store.Won {
				// The completion took effect at or after k.before, so its
				// ttl ends at k.before + ttl or later. A claim judged after
				// that instant (a machine slower than the ttl, which the
				// real-time harness of the SQL engines is when loaded) may
				// win: nothing to conclude.
				if judged := r.Claim.LeaseExpiry.Add(-e.long()); !judged.Before(k.before.Add(e.h.TTL).Add(-tolerance)) {
					t.Skipf("Claim of a key %s, completed at fence %d from %v, won fence %d at %v: the case ran slower than the ttl (%v): nothing to conclude",
						k.what, k.c.Fence, k.before, r.Claim.Fence, judged, e.h.TTL)
				}
				t.Fatalf("a done key re-run within its ttl: a key %s, completed at fence %d between %v and %v (the server's time), "+
					"ttl %v; a Claim %v later won fence %d",
					k.what, k.c.Fence, k.before, k.after, e.h.TTL, e.h.Now().Sub(k.after).Round(time.Millisecond), r.Claim.Fence)
			}
			if r.Outcome != store.AlreadyDone {
				t.Fatalf("Claim of a key %s and completed after it: %v, want already done", k.what, r.Outcome)
			}
			if !r.Until.IsZero() {
				e.within("AlreadyDone.Until after the jump", r.Until, k.before.Add(e.h.TTL), k.after.Add(e.h.TTL))
			}
		}
		if end := before.Add(e.h.TTL); e.justBefore(end) {
			r := e.claim(c.Key, e.long())
			if r.Outcome != store.AlreadyDone && !e.stillBefore(end) {
				return
			}
			if r.Outcome != store.AlreadyDone {
				t.Fatalf("a done key re-run within its ttl: Claim just before completion + ttl: %v, want already done", r.Outcome)
			}
		}
		e.at(after.Add(e.h.TTL))
		next := e.won(c.Key, e.long())
		if next.Fence != c.Fence+1 && next.Fence != 1 {
			t.Fatalf("Claim at completion + ttl: fence %d, want %d (kept) or 1 (reaped)", next.Fence, c.Fence+1)
		}
	})
}

// jumpAcross: a claim, and a completion, made just before the server's
// clock jumped. A real step of the server's clock moves when the lease and
// the ttl end in server terms: ahead, the lease lapses (and the ttl may
// end) at once; behind, both last longer. What a backend may never do is
// let a second caller win while, by the instants it reported itself, the
// first holder's lease (or the done key's ttl) is still running on the
// server's clock. An error is always allowed.
func jumpAcross(t *testing.T, e *env) {
	eachJump(t, e, func(t *testing.T, e *env, jump func()) {
		held, done := e.key(), e.key()
		c := e.won(held, e.short())
		d := e.won(done, e.long())
		dBefore, dAfter := e.completeWindow(d)
		jump()
		long := e.long()

		r, from, to := e.claimAgain(held, long)
		switch r.Outcome {
		case store.Won:
			// The instant the backend judged the claim at, by the lease it
			// reports; it must lie in the call, on the server's clock.
			judged := r.Claim.LeaseExpiry.Add(-long)
			e.within("the instant a claim after the jump was judged at (LeaseExpiry - lease)", judged, from, to)
			if judged.Before(c.LeaseExpiry.Add(-tolerance)) {
				t.Fatalf("two holders: fence %d holds the key until %v (its reported lease expiry), "+
					"and a Claim judged at %v (the server's time) won fence %d",
					c.Fence, c.LeaseExpiry, judged, r.Claim.Fence)
			}
			reaped := !to.Before(c.LeaseExpiry.Add(e.h.TTL))
			if r.Claim.Fence != c.Fence+1 && !(reaped && r.Claim.Fence == 1) {
				t.Fatalf("Claim after the holder's lease lapsed: fence %d, want %d", r.Claim.Fence, c.Fence+1)
			}
			e.complete(c, false)
			e.completeAgain(r.Claim)
		case store.HeldByOther:
			if !r.Until.IsZero() && !sameInstant(r.Until, c.LeaseExpiry) {
				t.Errorf("HeldByOther.Until = %v, want the holder's lease expiry %v", r.Until, c.LeaseExpiry)
			}
			// The holder from before the jump still holds the key.
			e.completeAgain(c)
		default:
			t.Fatalf("Claim of a key claimed before the jump: %v, want won or held by other", r.Outcome)
		}

		r, from, to = e.claimAgain(done, long)
		switch r.Outcome {
		case store.Won:
			judged := r.Claim.LeaseExpiry.Add(-long)
			e.within("the instant a claim after the jump was judged at (LeaseExpiry - lease)", judged, from, to)
			if judged.Before(dBefore.Add(e.h.TTL).Add(-tolerance)) {
				t.Fatalf("a done key re-run within its ttl: completed at fence %d between %v and %v (the server's time), "+
					"ttl %v; a Claim judged at %v (the server's time) won fence %d",
					d.Fence, dBefore, dAfter, e.h.TTL, judged, r.Claim.Fence)
			}
			if r.Claim.Fence != d.Fence+1 && r.Claim.Fence != 1 {
				t.Fatalf("Claim after the ttl: fence %d, want %d (kept) or 1 (reaped)", r.Claim.Fence, d.Fence+1)
			}
			e.complete(d, false)
			e.completeAgain(r.Claim)
		case store.AlreadyDone:
			if !r.Until.IsZero() {
				e.within("AlreadyDone.Until after the jump", r.Until, dBefore.Add(e.h.TTL), dAfter.Add(e.h.TTL))
			}
		default:
			t.Fatalf("Claim of a key completed before the jump: %v, want won or already done", r.Outcome)
		}
	})
}
