// Package storetest is the conformance suite for [store.Backend]
// implementations: every MUST rule of package store, each as a case. Every
// backend in this repository runs it, and so can a third party's, from a
// test in its own package:
//
//	func TestContract(t *testing.T) {
//		storetest.Run(t, func(t *testing.T) storetest.Harness {
//			clock := fake.NewClock(time.Now())
//			b := mybackend.New(db, mybackend.WithClock(clock.Now))
//			return storetest.Harness{
//				Backend: b,
//				TTL:     store.DefaultTTL,
//				Advance: clock.Advance, // or nil, with a short TTL, for a server's clock
//				Now:     clock.Now,
//				Faults:  proxy, // breaks the path to b's server; nil skips those cases
//				WithTTL: func(ttl time.Duration) store.Backend { // nil skips one case
//					return mybackend.New(db, mybackend.WithClock(clock.Now), mybackend.WithTTL(ttl))
//				},
//			}
//		})
//	}
//
// [Run] calls the function once per case, with that case's *testing.T, so
// each case gets a fresh [Harness]. Each case is a subtest named after the
// rule it checks ("zombie_cannot_complete_over_a_newer_claim"), runs in
// parallel with keys of its own, and can be selected with -run:
//
//	go test -run 'TestContract/zombie_cannot_complete' ./mybackend
//	go test -v -run 'TestContract/lease|TestContract/ttl' ./mybackend
//
// The optional parts of the port are checked when the backend has them. A
// backend that does not implement [store.Extender] skips the two cases about
// Extend, one without [store.Purger] skips the case about PurgeExpired, one
// without [store.Fingerprinter] skips the cases about payload fingerprints,
// a [Harness] without [Faults] skips the cases about lost replies and
// cut connections, one without [Harness].WithTTL the case about ttls at
// the limit of time.Duration, and one without ServerClock the cases about
// a server clock that jumps ahead of, or behind, the client's estimate of
// it (see [JumpHarness]); each skip says what it left unchecked. Every other case
// runs for every backend, and the cases that also touch an optional method
// (invalid keys, cancelled contexts, a claim from before a deletion, the
// history check) call it only when the backend has it.
//
// [CheckHistory] runs the history case on its own, with options.
//
// [RunOps] checks the operations interfaces ([store.Operator]: Inspect,
// List, ForceRelease, Forget) with the same kind of factory, one case per
// MUST rule of store/ops.go; a backend that does not implement
// store.Operator fails every one of them. It skips only the case about
// lost replies, without Faults:
//
//	func TestOps(t *testing.T) {
//		storetest.RunOps(t, func(t *testing.T) storetest.Harness {
//			// as for Run; ListMayRepeat: true for a List that may report
//			// a record twice (Redis SCAN)
//		})
//	}
package storetest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Harness is one backend under test and the means to move its time.
type Harness struct {
	// Backend is the backend under test. Required.
	Backend store.Backend

	// TTL is the ttl Backend applies. Required. It must be at least 10
	// Steps, so that nothing the suite expects to stay live expires while a
	// case runs.
	TTL time.Duration

	// Advance moves the backend's clock forward. When nil, the suite waits
	// in real time instead, so a backend whose clock cannot be driven (one
	// that reads a server's clock) should use a short TTL.
	Advance func(d time.Duration)

	// Step is the shortest lease the suite uses, and the margin it waits
	// past an instant before it expects the instant to have passed. It must
	// exceed the backend's clock granularity and the spread of its clocks.
	// Defaults: one minute with Advance, 100ms without.
	Step time.Duration

	// Now reads the backend's clock, for the cases that relate the instants
	// a backend reports to the time a call was made (the history check).
	// It is required when Advance is set. Without Advance, nil means
	// time.Now, right for a server on this machine.
	Now func() time.Time

	// Faults, when set, lets the suite break the path between Backend and
	// its server, to check that every method is safe to retry after a lost
	// reply or a cut connection. Cases that need it are skipped without it;
	// every networked backend should provide it. It must break this
	// Harness's Backend only (a proxy per case, for example): cases run in
	// parallel, and a reply lost on another case's call fails that case.
	Faults Faults

	// WithTTL, when set, returns a backend like Backend that applies ttl
	// instead of TTL, on the same clock (Advance moves it, Now reads it);
	// it may keep its records apart from Backend's or share its storage.
	// The case about ttls at the limit of time.Duration
	// (ttls_at_their_limit_never_expire_a_record_early) builds its
	// backends with it, and is skipped without it; every backend with a
	// ttl option should provide it.
	WithTTL func(ttl time.Duration) store.Backend

	// HistoryOps is how many calls the history case
	// (concurrent_histories_are_linearizable_with_leases_that_lapse, see
	// CheckHistory) makes. Zero means 10,000. A harness whose server is
	// slow may lower it for some of its runs, so long as one run of the
	// backend keeps at least 10,000.
	HistoryOps int

	// ServerClock, when set, returns a backend on a server whose clock the
	// cases about a server clock that jumps can move (see [JumpHarness]).
	// Only those cases call it, once for a jump ahead and once for a jump
	// behind, each with a *testing.T of its own, so a harness can start a
	// server for them alone (one under libfaketime, say) without the other
	// cases paying for it. Its jumps must move no other case's clock: a
	// server shared between calls must serve one of them at a time (hold a
	// lock until t's cleanup). Cases that need it are skipped without it;
	// every backend that judges time by a server's clock should provide it.
	ServerClock func(t *testing.T) JumpHarness

	// ListMayRepeat tells [RunOps] that the backend's List may report a
	// record more than once in one listing, as store.Lister allows a
	// backend whose store cannot read keys in order (Redis SCAN); the
	// suite then checks that every record appears at least once. False,
	// right for every backend that lists in key order, makes a repeated
	// record a failure.
	ListMayRepeat bool
}

// Faults breaks the path between a backend and its server. Both methods
// must be safe to call from any goroutine while calls are in flight.
type Faults interface {
	// LoseNextReply arranges for the next reply the server sends to be lost
	// after the server applied the request: the backend sees the connection
	// fail or an unavailable error, and cannot know whether its write landed.
	LoseNextReply()

	// CutConnections closes every open connection between the backend and
	// its server at once, as a crash of a network path would; calls in
	// flight fail mid-way.
	CutConnections()
}

type rule struct {
	name string
	run  func(t *testing.T, e *env)
}

// Run runs every case of the suite as a subtest of t. newHarness is called
// once per case, with the subtest's *testing.T, and must return a backend
// that does not share time with other cases (a fresh clock), or that is
// safe to share because cases use distinct keys.
func Run(t *testing.T, newHarness func(t *testing.T) Harness) {
	t.Helper()
	for _, r := range rules {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			r.run(t, newEnv(t, newHarness(t)))
		})
	}
}

// rules lists every case. The names read as "a backend should ...".
var rules = []rule{
	{"claim_on_an_absent_key_wins_with_fence_1", claimAbsent},
	{"claim_during_a_live_lease_is_held_by_other", claimHeld},
	{"claim_after_the_lease_lapsed_reclaims_with_fence_plus_1", claimLapsed},
	{"complete_with_the_current_fence_marks_done", completeCurrent},
	{"claim_of_a_done_key_within_the_ttl_is_already_done", claimDoneWithinTTL},
	{"claim_of_a_done_key_after_the_ttl_wins_again", claimDoneAfterTTL},
	{"complete_commits_after_the_lease_lapsed_if_nobody_reclaimed", completeAfterLapse},
	{"zombie_cannot_complete_over_a_newer_claim", zombieComplete},
	{"zombie_release_does_not_disturb_the_newer_claim", zombieRelease},
	{"release_makes_the_key_reclaimable_at_once_with_a_higher_fence", releaseReclaim},
	{"released_claim_can_never_complete", releasedNeverCompletes},
	{"complete_and_release_on_a_done_key_are_idempotent", doneIdempotent},
	{"complete_and_release_without_a_record_change_nothing", noRecord},
	{"mutex_cycle_reclaims_forever_without_ever_completing", mutexCycle},
	{"racing_claims_on_a_fresh_key_admit_exactly_one", raceFresh},
	{"racing_reclaims_on_a_lapsed_key_admit_exactly_one", raceLapsed},
	{"racing_claims_on_an_expired_done_key_admit_exactly_one_the_others_are_held", raceExpiredDone},
	{"claim_at_exactly_the_lease_expiry_wins_one_nanosecond_before_is_held", leaseInstant},
	{"the_ttl_runs_from_completion_and_ends_exactly_at_completion_plus_ttl", ttlInstant},
	{"a_claimed_record_outlives_its_lease_by_the_ttl", claimedOutlivesLease},
	{"a_released_record_outlives_the_release_by_the_ttl", releasedOutlives},
	{"an_extended_record_outlives_its_new_lease_by_the_ttl", extendedOutlives},
	{"a_claim_whose_reply_was_lost_is_won_or_an_error_never_held_or_done", lostClaim},
	{"a_complete_whose_reply_was_lost_is_safe_to_retry", lostComplete},
	{"a_release_whose_reply_was_lost_is_safe_to_retry", lostRelease},
	{"calls_cut_mid_flight_win_nothing_twice_and_converge", cutMidCall},
	{"keys_are_stored_verbatim_and_kept_apart", keysVerbatim},
	{"invalid_keys_are_refused", invalidKeys},
	{"non_positive_leases_are_refused", invalidLease},
	{"a_cancelled_context_fails_and_changes_nothing", cancelledContext},
	{"extend_renews_only_the_current_claim", extend},
	{"purge_removes_only_expired_records", purge},
	{"a_claim_from_before_its_record_was_deleted_cannot_touch_the_new_record", claimFromBeforeDeletion},
	{"a_claim_whose_token_only_resembles_the_holders_touches_nothing", lookalikeTokens},
	{"concurrent_histories_are_linearizable_with_leases_that_lapse", historyCase},
	{"leases_at_their_limit_never_expire_a_claim_early", leaseLimits},
	{"extends_at_their_limit_never_expire_a_claim_early", extendLimits},
	{"ttls_at_their_limit_never_expire_a_record_early", ttlLimits},
	{"a_fingerprint_stored_by_complete_is_reported_while_the_key_is_done", fpReported},
	{"a_plain_complete_stores_no_fingerprint", fpPlain},
	{"a_retried_complete_with_the_same_fence_keeps_the_first_fingerprint", fpRetried},
	{"a_stale_or_released_claim_stores_no_fingerprint", fpStale},
	{"a_reclaim_after_the_ttl_leaves_no_fingerprint_behind", fpReclaim},
	{"invalid_fingerprints_are_refused_and_change_nothing", fpInvalid},
	{"fingerprints_are_stored_verbatim_up_to_MaxFingerprintLen", fpVerbatim},
	{"a_complete_with_a_fingerprint_whose_reply_was_lost_is_safe_to_retry", fpLost},

	// A server clock that jumps (Harness.ServerClock).
	{"a_claim_won_after_the_server_clock_jumped_is_held_for_its_lease", jumpThenClaim},
	{"a_key_completed_after_the_server_clock_jumped_is_done_for_its_ttl", jumpThenComplete},
	{"a_claim_or_completion_from_before_the_server_clock_jumped_never_makes_two_holders", jumpAcross},
}

type env struct {
	t    *testing.T
	h    Harness
	ctx  context.Context
	base string
	n    int
	// done records, per key, the fence of its latest completion and when
	// that Complete started, to tell a slow machine from a short ttl.
	done map[string]completion
}

type completion struct {
	fence int64
	at    time.Time
}

func newEnv(t *testing.T, h Harness) *env {
	t.Helper()
	if h.Backend == nil {
		t.Fatal("storetest: Harness.Backend is nil")
	}
	if h.Advance != nil && h.Now == nil {
		t.Fatal("storetest: Harness.Now is required when Advance is set")
	}
	if h.Now == nil {
		h.Now = time.Now
	}
	if h.Step <= 0 {
		h.Step = 100 * time.Millisecond
		if h.Advance != nil {
			h.Step = time.Minute
		}
	}
	if h.TTL < 10*h.Step {
		t.Fatalf("storetest: Harness.TTL %v must be at least 10 Steps (%v)", h.TTL, 10*h.Step)
	}
	name := t.Name()
	if i := strings.LastIndexByte(name, '/'); i >= 0 {
		name = name[i+1:]
	}
	if len(name) > 40 {
		name = name[:40]
	}
	return &env{
		t:    t,
		h:    h,
		ctx:  t.Context(),
		base: fmt.Sprintf("storetest/%s/%016x", name, rand.Uint64()),
		done: map[string]completion{},
	}
}

// key returns a key no other case uses.
func (e *env) key() string {
	e.n++
	return fmt.Sprintf("%s/%d", e.base, e.n)
}

// long is a lease that never lapses while a case runs.
func (e *env) long() time.Duration { return time.Hour }

// short is a lease the suite lets lapse with e.pass.
func (e *env) short() time.Duration { return e.h.Step }

// pass lets d plus one Step go by on the backend's clock.
func (e *env) pass(d time.Duration) {
	d += e.h.Step
	if e.h.Advance != nil {
		e.h.Advance(d)
		return
	}
	time.Sleep(d)
}

func (e *env) claim(key string, lease time.Duration) store.Result {
	e.t.Helper()
	before := e.h.Now()
	r, err := e.h.Backend.Claim(e.ctx, key, lease)
	after := e.h.Now()
	if err != nil {
		e.t.Fatalf("Claim(%q, %v): %v", key, lease, err)
	}
	if r.Outcome != store.AlreadyDone && r.Fingerprint != "" {
		e.t.Fatalf("Claim(%q): %v with fingerprint %q; only already done reports one", key, r.Outcome, r.Fingerprint)
	}
	if r.Outcome == store.Won {
		// The new lease runs for lease from the backend's now, which lies
		// within the call.
		e.within("Claim.LeaseExpiry", r.Claim.LeaseExpiry, store.Instant(before, 0, lease), store.Instant(after, 0, lease))
	}
	return r
}

// tolerance absorbs backends that keep milliseconds.
const tolerance = 2 * time.Millisecond

// within fails the case unless instant got lies in [lo, hi], give or take
// the tolerance.
func (e *env) within(what string, got, lo, hi time.Time) {
	e.t.Helper()
	if got.Before(lo.Add(-tolerance)) || got.After(hi.Add(tolerance)) {
		e.t.Fatalf("%s = %v, want within [%v, %v]", what, got, lo, hi)
	}
}

// justBefore moves the backend's clock to just before instant: exactly one
// nanosecond before with Advance, one Step before in real time. In real time
// it reports false when that moment has already gone by (a loaded machine),
// and the caller skips the check it meant to place there.
func (e *env) justBefore(instant time.Time) bool {
	e.t.Helper()
	if e.h.Advance != nil {
		e.moveTo(instant.Add(-time.Nanosecond))
		return true
	}
	d := instant.Add(-e.h.Step).Sub(e.h.Now())
	if d < 0 {
		e.t.Logf("real time already passed %v minus a Step; check skipped", instant)
		return false
	}
	time.Sleep(d)
	return true
}

// stillBefore reports whether the calls made since justBefore all returned
// before instant. It is always true with Advance. In real time a loaded
// machine can overshoot; what those calls saw then proves nothing, and the
// case ends with a log line instead of a verdict.
func (e *env) stillBefore(instant time.Time) bool {
	e.t.Helper()
	if e.h.Advance != nil || e.h.Now().Before(instant) {
		return true
	}
	e.t.Logf("the calls placed before %v returned after it (a loaded machine); nothing to conclude", instant)
	return false
}

// at moves the backend's clock to instant exactly with Advance, and one
// Step past it in real time.
func (e *env) at(instant time.Time) {
	e.t.Helper()
	if e.h.Advance != nil {
		e.moveTo(instant)
		return
	}
	time.Sleep(instant.Add(e.h.Step).Sub(e.h.Now()))
}

func (e *env) moveTo(instant time.Time) {
	e.t.Helper()
	d := instant.Sub(e.h.Now())
	if d < 0 {
		e.t.Fatalf("storetest: the clock is already %v past %v", -d, instant)
	}
	e.h.Advance(d)
}

// faults returns the Harness's Faults, or skips the case without them.
func (e *env) faults() Faults {
	e.t.Helper()
	if e.h.Faults == nil {
		e.t.Skip("Harness.Faults is nil: retry safety after lost replies and cut connections is not checked; every networked backend should provide it")
	}
	return e.h.Faults
}

// extender returns the backend as a store.Extender, or skips the case when
// it is not one.
func (e *env) extender() store.Extender {
	e.t.Helper()
	x, ok := e.h.Backend.(store.Extender)
	if !ok {
		e.t.Skipf("%T does not implement store.Extender: Extend is not checked (without it, long work cannot renew its lease)", e.h.Backend)
	}
	return x
}

// purger returns the backend as a store.Purger, or skips the case when it
// is not one.
func (e *env) purger() store.Purger {
	e.t.Helper()
	p, ok := e.h.Backend.(store.Purger)
	if !ok {
		e.t.Skipf("%T does not implement store.Purger: PurgeExpired is not checked (its storage must delete expired records by itself)", e.h.Backend)
	}
	return p
}

func (e *env) won(key string, lease time.Duration) store.Claim {
	e.t.Helper()
	r := e.claim(key, lease)
	if r.Outcome != store.Won {
		e.t.Fatalf("Claim(%q): outcome %v, want won", key, r.Outcome)
	}
	if r.Claim.Key != key {
		e.t.Fatalf("Claim(%q): Claim.Key = %q", key, r.Claim.Key)
	}
	if r.Claim.Token == "" {
		e.t.Fatalf("Claim(%q): empty claim token", key)
	}
	if r.Claim.LeaseExpiry.IsZero() {
		e.t.Fatalf("Claim(%q): zero lease expiry", key)
	}
	return r.Claim
}

func (e *env) expect(key string, want store.Outcome) store.Result {
	e.t.Helper()
	r := e.claim(key, e.long())
	if r.Outcome != want {
		// In real time, a case the machine ran slower than the ttl proves
		// nothing about a key it expects still done.
		if d, ok := e.done[key]; ok && want == store.AlreadyDone && e.h.Advance == nil && !e.h.Now().Before(d.at.Add(e.h.TTL)) {
			e.t.Skipf("Claim(%q): outcome %v, but the case ran slower than the ttl (%v since the completion): nothing to conclude",
				key, r.Outcome, e.h.Now().Sub(d.at).Round(time.Millisecond))
		}
		e.t.Fatalf("Claim(%q): outcome %v, want %v", key, r.Outcome, want)
	}
	return r
}

func (e *env) complete(c store.Claim, want bool) {
	e.t.Helper()
	before := e.h.Now()
	ok, err := e.h.Backend.Complete(e.ctx, c)
	if err != nil {
		e.t.Fatalf("Complete(%q, fence %d): %v", c.Key, c.Fence, err)
	}
	if ok != want {
		e.t.Fatalf("Complete(%q, fence %d) = %v, want %v", c.Key, c.Fence, ok, want)
	}
	if d, seen := e.done[c.Key]; ok && (!seen || d.fence != c.Fence) {
		e.done[c.Key] = completion{c.Fence, before}
	}
}

// completeWindow completes c, which must succeed, and returns the window
// of the backend's clock in which it took effect.
func (e *env) completeWindow(c store.Claim) (before, after time.Time) {
	e.t.Helper()
	before = e.h.Now()
	e.complete(c, true)
	return before, e.h.Now()
}

func (e *env) release(c store.Claim) {
	e.t.Helper()
	if err := e.h.Backend.Release(e.ctx, c); err != nil {
		e.t.Fatalf("Release(%q, fence %d): %v", c.Key, c.Fence, err)
	}
}

// sameInstant allows for backends that keep milliseconds.
func sameInstant(a, b time.Time) bool {
	d := a.Sub(b)
	return d > -time.Millisecond && d < time.Millisecond
}

func claimAbsent(t *testing.T, e *env) {
	c := e.won(e.key(), e.long())
	if c.Fence != 1 {
		t.Fatalf("fence = %d, want 1", c.Fence)
	}
}

func claimHeld(t *testing.T, e *env) {
	k := e.key()
	c := e.won(k, e.long())
	r := e.expect(k, store.HeldByOther)
	if !r.Until.IsZero() && !sameInstant(r.Until, c.LeaseExpiry) {
		t.Errorf("HeldByOther.Until = %v, want the holder's lease expiry %v", r.Until, c.LeaseExpiry)
	}
	// The failed claim changed nothing: the holder still completes.
	e.complete(c, true)
}

func claimLapsed(t *testing.T, e *env) {
	k := e.key()
	first := e.won(k, e.short())
	e.pass(e.short())
	second := e.won(k, e.long())
	if second.Fence != first.Fence+1 {
		t.Fatalf("reclaim fence = %d, want %d", second.Fence, first.Fence+1)
	}
	if second.Token == first.Token {
		t.Errorf("reclaim reused the claim token %q", first.Token)
	}
	e.expect(k, store.HeldByOther)
}

func completeCurrent(t *testing.T, e *env) {
	k := e.key()
	c := e.won(k, e.long())
	e.complete(c, true)
	e.expect(k, store.AlreadyDone)
}

func claimDoneWithinTTL(t *testing.T, e *env) {
	k := e.key()
	c := e.won(k, e.long())
	e.pass(e.short())
	before, after := e.completeWindow(c)
	e.pass(e.h.TTL / 2)
	r := e.expect(k, store.AlreadyDone)
	if !r.Until.IsZero() {
		// Suppression ends at completion + ttl.
		e.within("AlreadyDone.Until", r.Until, before.Add(e.h.TTL), after.Add(e.h.TTL))
	}
	// A mutex-style claim with a short lease is refused as well.
	if r := e.claim(k, e.short()); r.Outcome != store.AlreadyDone {
		// As in expect: in real time, a machine slower than the ttl proves
		// nothing here.
		if d, ok := e.done[k]; ok && e.h.Advance == nil && !e.h.Now().Before(d.at.Add(e.h.TTL)) {
			t.Skipf("short-lease claim of a done key: %v, but the case ran slower than the ttl (%v since the completion): nothing to conclude",
				r.Outcome, e.h.Now().Sub(d.at))
		}
		t.Fatalf("short-lease claim of a done key: %v, want already done", r.Outcome)
	}
}

func claimDoneAfterTTL(t *testing.T, e *env) {
	k := e.key()
	c := e.won(k, e.long())
	e.complete(c, true)
	e.pass(e.h.TTL)
	again := e.won(k, e.long())
	// The record may have been reaped after its expires-at instant, in which
	// case a fresh record starts at fence 1.
	if again.Fence != c.Fence+1 && again.Fence != 1 {
		t.Fatalf("fence after ttl = %d, want %d (kept) or 1 (reaped)", again.Fence, c.Fence+1)
	}
	e.complete(again, true)
	e.expect(k, store.AlreadyDone)
}

func completeAfterLapse(t *testing.T, e *env) {
	k := e.key()
	c := e.won(k, e.short())
	e.pass(e.short())
	e.complete(c, true)
	e.expect(k, store.AlreadyDone)
}

func zombieComplete(t *testing.T, e *env) {
	k := e.key()
	zombie := e.won(k, e.short())
	e.pass(e.short())
	fresh := e.won(k, e.long())
	e.complete(zombie, false)
	// The zombie's refusal left the newer claim intact.
	e.expect(k, store.HeldByOther)
	e.complete(fresh, true)
	e.expect(k, store.AlreadyDone)
	e.complete(zombie, false)
}

func zombieRelease(t *testing.T, e *env) {
	k := e.key()
	zombie := e.won(k, e.short())
	e.pass(e.short())
	fresh := e.won(k, e.long())
	e.release(zombie)
	e.expect(k, store.HeldByOther)
	e.complete(fresh, true)
	e.release(zombie)
	e.expect(k, store.AlreadyDone)
}

func releaseReclaim(t *testing.T, e *env) {
	k := e.key()
	c := e.won(k, e.long())
	e.release(c)
	next := e.won(k, e.long())
	if next.Fence != c.Fence+2 {
		t.Fatalf("fence after release and reclaim = %d, want %d (release +1, reclaim +1)", next.Fence, c.Fence+2)
	}
	e.expect(k, store.HeldByOther)
}

func releasedNeverCompletes(t *testing.T, e *env) {
	k := e.key()
	c := e.won(k, e.long())
	e.release(c)
	e.complete(c, false)
	// Releasing twice is harmless, and the key is still not done.
	e.release(c)
	e.complete(c, false)
	next := e.won(k, e.long())
	e.complete(c, false)
	e.complete(next, true)
}

func doneIdempotent(t *testing.T, e *env) {
	k := e.key()
	c := e.won(k, e.long())
	e.complete(c, true)
	e.complete(c, true)
	e.release(c)
	e.expect(k, store.AlreadyDone)
	e.complete(c, true)
}

func noRecord(t *testing.T, e *env) {
	k := e.key()
	ghost := store.Claim{Key: k, Fence: 1, Token: "ghost", LeaseExpiry: time.Now().Add(time.Hour)}
	e.complete(ghost, false)
	if f, ok := e.h.Backend.(store.Fingerprinter); ok {
		e.completeFP(f, ghost, "ghost", false)
	}
	e.release(ghost)
	c := e.won(k, e.long())
	if c.Fence != 1 {
		t.Fatalf("fence = %d after complete/release of a missing record, want 1", c.Fence)
	}
}

func mutexCycle(t *testing.T, e *env) {
	k := e.key()
	var prev []store.Claim
	for i := range 5 {
		c := e.won(k, e.long())
		if len(prev) > 0 && c.Fence <= prev[len(prev)-1].Fence {
			t.Fatalf("cycle %d: fence %d did not rise above %d", i, c.Fence, prev[len(prev)-1].Fence)
		}
		e.expect(k, store.HeldByOther)
		e.release(c)
		prev = append(prev, c)
	}
	for _, c := range prev {
		e.complete(c, false)
	}
	e.won(k, e.long())
}

func race(t *testing.T, e *env, k string, lease time.Duration) []store.Result {
	const n = 16
	var (
		wg      sync.WaitGroup
		start   = make(chan struct{})
		results = make([]store.Result, n)
		errs    = make([]error, n)
	)
	for i := range n {
		wg.Go(func() {
			<-start
			results[i], errs[i] = e.h.Backend.Claim(e.ctx, k, lease)
		})
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("racer %d: %v", i, err)
		}
	}
	return results
}

func onlyWinner(t *testing.T, results []store.Result) store.Claim {
	t.Helper()
	var winners []store.Claim
	for _, r := range results {
		switch r.Outcome {
		case store.Won:
			winners = append(winners, r.Claim)
		case store.HeldByOther:
		default:
			t.Fatalf("racer got %v (until %v): a racer that lost must be held by the winner", r.Outcome, r.Until)
		}
	}
	if len(winners) != 1 {
		t.Fatalf("%d racers won, want exactly 1: %+v", len(winners), winners)
	}
	return winners[0]
}

func raceFresh(t *testing.T, e *env) {
	k := e.key()
	w := onlyWinner(t, race(t, e, k, e.long()))
	if w.Fence != 1 {
		t.Fatalf("winner fence = %d, want 1", w.Fence)
	}
	e.complete(w, true)
}

func raceLapsed(t *testing.T, e *env) {
	k := e.key()
	first := e.won(k, e.short())
	e.pass(e.short())
	w := onlyWinner(t, race(t, e, k, e.long()))
	if w.Fence != first.Fence+1 {
		t.Fatalf("winner fence = %d, want %d", w.Fence, first.Fence+1)
	}
	e.complete(first, false)
	e.complete(w, true)
}

func keysVerbatim(t *testing.T, e *env) {
	p := e.key() + "/"
	// Keys come in look-alike groups: a backend that folds case, trims,
	// normalises Unicode, replaces invalid UTF-8, cleans paths or truncates
	// (anywhere short of MaxKeyLen) makes two of them one record.
	keys := []string{
		p + "orders:po-123",
		p + "ünïcødé/ключ/鍵/🔑",
		p + "a/b/../c//d",
		p + "a/c/d",
		p + "with spaces\tand\ttabs\nand newline",
		p + "\x01\x02\x7f\x80\xfe\xff",
		p + "\x01\x02\x7f\x80\xff\xfe",
		p + "{hash}tag{x}",
		p + "quote' \"; DROP TABLE records; --",
		p + `%s %d \ \\ *?[]`,
		p + "Case",
		p + "case",
		p + "case ",
		p + " case",
		p + "caf\u00e9",
		p + "cafe\u0301",
		p + strings.Repeat("k", store.MaxKeyLen-len(p)-1) + "1",
		p + strings.Repeat("k", store.MaxKeyLen-len(p)-1) + "2",
		p + strings.Repeat("k", 600) + "1",
		p + strings.Repeat("k", 600) + "2",
	}
	claims := make([]store.Claim, len(keys))
	for i, k := range keys {
		claims[i] = e.won(k, e.long())
		if claims[i].Fence != 1 {
			t.Fatalf("key %q: fence %d, want 1 (keys collided)", k, claims[i].Fence)
		}
	}
	// Completing one key of each pair leaves its twin held.
	for i, c := range claims {
		if i%2 == 0 {
			e.complete(c, true)
			e.expect(keys[i], store.AlreadyDone)
		} else {
			e.expect(keys[i], store.HeldByOther)
		}
	}
}

func invalidKeys(t *testing.T, e *env) {
	x, _ := e.h.Backend.(store.Extender)
	for _, k := range []string{"", "nul\x00byte", strings.Repeat("x", store.MaxKeyLen+1)} {
		_, err := e.h.Backend.Claim(e.ctx, k, e.long())
		if !errors.Is(err, store.ErrInvalidKey) {
			t.Errorf("Claim(%.20q...): err = %v, want ErrInvalidKey", k, err)
		}
		// Every method validates its arguments, the key of a Claim too.
		c := store.Claim{Key: k, Fence: 1, Token: "t", LeaseExpiry: e.h.Now().Add(time.Hour)}
		if ok, err := e.h.Backend.Complete(e.ctx, c); ok || !errors.Is(err, store.ErrInvalidKey) {
			t.Errorf("Complete(%.20q...) = %v, %v, want ErrInvalidKey", k, ok, err)
		}
		if err := e.h.Backend.Release(e.ctx, c); !errors.Is(err, store.ErrInvalidKey) {
			t.Errorf("Release(%.20q...): err = %v, want ErrInvalidKey", k, err)
		}
		if x != nil {
			if _, err := x.Extend(e.ctx, c, e.long()); !errors.Is(err, store.ErrInvalidKey) {
				t.Errorf("Extend(%.20q...): err = %v, want ErrInvalidKey", k, err)
			}
		}
		if f, ok := e.h.Backend.(store.Fingerprinter); ok {
			if ok, err := f.CompleteFingerprint(e.ctx, c, "fp"); ok || !errors.Is(err, store.ErrInvalidKey) {
				t.Errorf("CompleteFingerprint(%.20q...) = %v, %v, want ErrInvalidKey", k, ok, err)
			}
		}
	}
	// The longest valid key is valid.
	long := e.key() + "/"
	e.won(long+strings.Repeat("x", store.MaxKeyLen-len(long)), e.long())
}

func invalidLease(t *testing.T, e *env) {
	k := e.key()
	for _, lease := range []time.Duration{0, -time.Second} {
		_, err := e.h.Backend.Claim(e.ctx, k, lease)
		if !errors.Is(err, store.ErrInvalidLease) {
			t.Errorf("Claim(lease %v): err = %v, want ErrInvalidLease", lease, err)
		}
	}
	// Nothing was claimed by the refused calls.
	if c := e.won(k, e.long()); c.Fence != 1 {
		t.Fatalf("fence = %d, want 1", c.Fence)
	}
}

func cancelledContext(t *testing.T, e *env) {
	dead, cancel := context.WithCancel(e.ctx)
	cancel()
	k := e.key()
	if _, err := e.h.Backend.Claim(dead, k, e.long()); !errors.Is(err, context.Canceled) {
		t.Fatalf("Claim with a cancelled context: err = %v, want context.Canceled", err)
	}
	c := e.won(k, e.long())
	if c.Fence != 1 {
		t.Fatalf("fence = %d after a cancelled claim, want 1", c.Fence)
	}
	if _, err := e.h.Backend.Complete(dead, c); !errors.Is(err, context.Canceled) {
		t.Fatalf("Complete with a cancelled context: err = %v, want context.Canceled", err)
	}
	if err := e.h.Backend.Release(dead, c); !errors.Is(err, context.Canceled) {
		t.Fatalf("Release with a cancelled context: err = %v, want context.Canceled", err)
	}
	if x, ok := e.h.Backend.(store.Extender); ok {
		if _, err := x.Extend(dead, c, e.long()); !errors.Is(err, context.Canceled) {
			t.Fatalf("Extend with a cancelled context: err = %v, want context.Canceled", err)
		}
	}
	if f, ok := e.h.Backend.(store.Fingerprinter); ok {
		if ok, err := f.CompleteFingerprint(dead, c, "fp"); ok || !errors.Is(err, context.Canceled) {
			t.Fatalf("CompleteFingerprint with a cancelled context = %v, %v, want context.Canceled", ok, err)
		}
	}
	// The refused calls changed nothing: c still holds the key, at fence 1.
	e.expect(k, store.HeldByOther)
	e.complete(c, true)
	e.expect(k, store.AlreadyDone)
	if p, ok := e.h.Backend.(store.Purger); ok {
		if _, err := p.PurgeExpired(dead, 0); !errors.Is(err, context.Canceled) {
			t.Fatalf("PurgeExpired with a cancelled context: err = %v, want context.Canceled", err)
		}
	}
}

func extend(t *testing.T, e *env) {
	x := e.extender()
	k := e.key()
	c := e.won(k, e.short())
	if e.h.Advance != nil {
		e.h.Advance(e.h.Step / 2)
	} else {
		time.Sleep(e.h.Step / 2)
	}
	before := e.h.Now()
	ext, err := x.Extend(e.ctx, c, e.long())
	after := e.h.Now()
	if err != nil {
		t.Fatalf("Extend: %v", err)
	}
	if ext.Fence != c.Fence || ext.Token != c.Token || ext.Key != c.Key {
		t.Fatalf("Extend returned fence %d token %q key %q; want the claim's %d %q %q",
			ext.Fence, ext.Token, ext.Key, c.Fence, c.Token, c.Key)
	}
	// The new lease runs from the backend's now, not from the old expiry.
	e.within("Extend's LeaseExpiry", ext.LeaseExpiry, before.Add(e.long()), after.Add(e.long()))
	e.pass(e.short())
	r := e.expect(k, store.HeldByOther)
	if !r.Until.IsZero() && !sameInstant(r.Until, ext.LeaseExpiry) {
		t.Errorf("HeldByOther.Until = %v, want the extended lease expiry %v", r.Until, ext.LeaseExpiry)
	}
	if _, err := x.Extend(e.ctx, c, 0); !errors.Is(err, store.ErrInvalidLease) {
		t.Errorf("Extend(lease 0): err = %v, want ErrInvalidLease", err)
	}
	if _, err := x.Extend(e.ctx, c, -time.Second); !errors.Is(err, store.ErrInvalidLease) {
		t.Errorf("Extend(lease -1s): err = %v, want ErrInvalidLease", err)
	}
	// Extending with the original claim (its old LeaseExpiry) is the same
	// claim: only the fence identifies it.
	e.complete(c, true)
	if _, err := x.Extend(e.ctx, c, e.long()); !errors.Is(err, store.ErrLost) {
		t.Errorf("Extend of a done claim: err = %v, want ErrLost", err)
	}
	e.expect(k, store.AlreadyDone)

	k2 := e.key()
	zombie := e.won(k2, e.short())
	e.pass(e.short())
	fresh := e.won(k2, e.short())
	if _, err := x.Extend(e.ctx, zombie, e.long()); !errors.Is(err, store.ErrLost) {
		t.Errorf("Extend of a stale claim: err = %v, want ErrLost", err)
	}
	// The zombie's refused extension did not lengthen the fresh lease.
	e.pass(e.short())
	if r := e.claim(k2, e.long()); r.Outcome != store.Won || r.Claim.Fence != fresh.Fence+1 {
		t.Fatalf("claim after the fresh lease lapsed: %v fence %d, want won fence %d",
			r.Outcome, r.Claim.Fence, fresh.Fence+1)
	}

	// A holder whose lease lapsed but whom nobody replaced still holds the
	// record with its fence: it may extend, like it may complete.
	k3 := e.key()
	late := e.won(k3, e.short())
	e.pass(e.short())
	again, err := x.Extend(e.ctx, late, e.long())
	if err != nil {
		t.Fatalf("Extend of a lapsed claim nobody replaced: %v", err)
	}
	if again.Fence != late.Fence {
		t.Fatalf("Extend changed the fence from %d to %d", late.Fence, again.Fence)
	}
	e.expect(k3, store.HeldByOther)
	e.complete(late, true)

	// A released claim cannot extend.
	k4 := e.key()
	rel := e.won(k4, e.long())
	e.release(rel)
	if _, err := x.Extend(e.ctx, rel, e.long()); !errors.Is(err, store.ErrLost) {
		t.Errorf("Extend of a released claim: err = %v, want ErrLost", err)
	}
	if c := e.won(k4, e.long()); c.Fence != rel.Fence+2 {
		t.Fatalf("claim after release: fence %d, want %d", c.Fence, rel.Fence+2)
	}
}

func purge(t *testing.T, e *env) {
	p := e.purger()
	expired, done, held, lapsed := e.key(), e.key(), e.key(), e.key()
	old := e.won(expired, e.long())
	e.complete(old, true)
	e.pass(e.h.TTL)
	d := e.won(done, e.long())
	before, _ := e.completeWindow(d)
	e.won(held, e.long())
	e.won(lapsed, e.short())
	e.pass(e.short())

	n, err := p.PurgeExpired(e.ctx, 0)
	if err != nil {
		t.Fatalf("PurgeExpired: %v", err)
	}
	if n < 1 {
		t.Fatalf("PurgeExpired removed %d records, want at least the expired one", n)
	}
	e.expect(done, store.AlreadyDone)
	e.expect(held, store.HeldByOther)
	if c := e.won(expired, e.long()); c.Fence != 1 {
		t.Fatalf("expired key after purge: fence %d, want 1 (a fresh record)", c.Fence)
	}
	// A lapsed lease is not an expired record: it lives for the ttl past
	// its lease, so the lapsed holder's fence stays unique.
	if c := e.won(lapsed, e.long()); c.Fence != 2 {
		t.Fatalf("lapsed key after purge: fence %d, want 2 (the record kept)", c.Fence)
	}

	// Up to the last nanosecond of its ttl, a done record is kept.
	if e.justBefore(before.Add(e.h.TTL)) {
		if _, err := p.PurgeExpired(e.ctx, 0); err != nil {
			t.Fatalf("PurgeExpired: %v", err)
		}
		r := e.claim(done, e.long())
		if r.Outcome != store.AlreadyDone && e.stillBefore(before.Add(e.h.TTL)) {
			t.Fatalf("done key purged before its expires-at: %v, want already done", r.Outcome)
		}
	}

	// The limit bounds one call.
	var keys []string
	for range 3 {
		k := e.key()
		e.complete(e.won(k, e.long()), true)
		keys = append(keys, k)
	}
	e.pass(e.h.TTL)
	if n, err := p.PurgeExpired(e.ctx, 1); err != nil || n > 1 {
		t.Fatalf("PurgeExpired(limit 1) = %d, %v; want at most 1", n, err)
	}
	if _, err := p.PurgeExpired(e.ctx, 0); err != nil {
		t.Fatalf("PurgeExpired: %v", err)
	}
	for _, k := range keys {
		if c := e.won(k, e.long()); c.Fence != 1 {
			t.Fatalf("expired key %q after purge: fence %d, want 1", k, c.Fence)
		}
	}
}

// raceExpiredDone races claims on keys whose Done ttl has elapsed. A loser
// must see the winner's fresh claim, never the stale Done record: an
// AlreadyDone here acks a delivery whose body may yet fail and release.
// Forty rounds, since a stale read shows only in some interleavings (the
// PostgreSQL defect of issue 9 showed in 3 to 30 rounds of 40; with twelve
// rounds the suite missed it about one run in three).
func raceExpiredDone(t *testing.T, e *env) {
	const rounds = 40
	keys := make([]string, rounds)
	done := make([]store.Claim, rounds)
	for i := range keys {
		keys[i] = e.key()
		done[i] = e.won(keys[i], e.long())
		e.complete(done[i], true)
	}
	e.pass(e.h.TTL)
	for i, k := range keys {
		results := race(t, e, k, e.long())
		w := onlyWinner(t, results)
		// The record may have been reaped after its expires-at instant.
		if w.Fence != done[i].Fence+1 && w.Fence != 1 {
			t.Fatalf("round %d: winner fence = %d, want %d (kept) or 1 (reaped)", i, w.Fence, done[i].Fence+1)
		}
		for _, r := range results {
			if r.Outcome == store.HeldByOther && !r.Until.IsZero() && !sameInstant(r.Until, w.LeaseExpiry) {
				t.Fatalf("round %d: HeldByOther.Until = %v, want the winner's lease expiry %v", i, r.Until, w.LeaseExpiry)
			}
		}
		e.complete(done[i], false)
		e.complete(w, true)
		e.expect(k, store.AlreadyDone)
	}
}

// leaseInstant places claims at the last nanosecond of a lease and at its
// expiry (with Advance; a Step either side in real time).
func leaseInstant(t *testing.T, e *env) {
	k := e.key()
	lease := 3 * e.h.Step
	c := e.won(k, lease)
	if e.justBefore(c.LeaseExpiry) {
		r := e.claim(k, e.long())
		if r.Outcome != store.HeldByOther && !e.stillBefore(c.LeaseExpiry) {
			return
		}
		if r.Outcome != store.HeldByOther {
			t.Fatalf("claim before the lease expiry: %v, want held by other", r.Outcome)
		}
		if !r.Until.IsZero() && !sameInstant(r.Until, c.LeaseExpiry) {
			t.Errorf("HeldByOther.Until = %v, want the lease expiry %v", r.Until, c.LeaseExpiry)
		}
		// A short-lease claim is held just the same.
		r = e.claim(k, e.short())
		if r.Outcome != store.HeldByOther && !e.stillBefore(c.LeaseExpiry) {
			return
		}
		if r.Outcome != store.HeldByOther {
			t.Fatalf("short-lease claim before the lease expiry: %v, want held by other", r.Outcome)
		}
	}
	e.at(c.LeaseExpiry)
	next := e.won(k, e.long())
	if next.Fence != c.Fence+1 {
		t.Fatalf("claim at the lease expiry: fence %d, want %d", next.Fence, c.Fence+1)
	}
	e.complete(c, false)
	e.complete(next, true)
}

// ttlInstant pins when suppression ends: ttl after completion (not after
// the claim, nor after the lease), not a nanosecond sooner, and a second
// Complete does not restart it.
func ttlInstant(t *testing.T, e *env) {
	k := e.key()
	c := e.won(k, e.long())
	// Complete well after the claim, so a ttl counted from the claim ends
	// visibly too early.
	e.pass(2 * e.h.Step)
	before, after := e.completeWindow(c)
	e.pass(e.short())
	e.complete(c, true) // changes nothing, the ttl included
	if end := before.Add(e.h.TTL); e.justBefore(end) {
		r := e.claim(k, e.long())
		if r.Outcome != store.AlreadyDone && !e.stillBefore(end) {
			return
		}
		if r.Outcome != store.AlreadyDone {
			t.Fatalf("claim before the ttl ends: %v, want already done", r.Outcome)
		}
		if !r.Until.IsZero() {
			e.within("AlreadyDone.Until", r.Until, before.Add(e.h.TTL), after.Add(e.h.TTL))
		}
		r = e.claim(k, e.short())
		if r.Outcome != store.AlreadyDone && !e.stillBefore(end) {
			return
		}
		if r.Outcome != store.AlreadyDone {
			t.Fatalf("short-lease claim before the ttl ends: %v, want already done", r.Outcome)
		}
	}
	e.at(after.Add(e.h.TTL))
	next := e.won(k, e.long())
	if next.Fence != c.Fence+1 && next.Fence != 1 {
		t.Fatalf("claim at completion + ttl: fence %d, want %d (kept) or 1 (reaped)", next.Fence, c.Fence+1)
	}
	e.complete(c, false)
	e.complete(next, true)
}

// purgeIfAble deletes expired records when the backend is a Purger (a
// backend that reaps by itself, like Redis, has already done so).
func (e *env) purgeIfAble() {
	e.t.Helper()
	if p, ok := e.h.Backend.(store.Purger); ok {
		if _, err := p.PurgeExpired(e.ctx, 0); err != nil {
			e.t.Fatalf("PurgeExpired: %v", err)
		}
	}
}

// claimedOutlivesLease: a Claimed record expires at lease expiry + ttl.
// Deleted sooner, the next claim restarts the fence at 1 and the lapsed
// holder's fence matches again: it could complete the newcomer's claim.
func claimedOutlivesLease(t *testing.T, e *env) {
	k := e.key()
	c := e.won(k, 3*e.h.Step)
	if !e.justBefore(c.LeaseExpiry.Add(e.h.TTL)) {
		return
	}
	e.purgeIfAble()
	next := e.won(k, e.long())
	if next.Fence != c.Fence+1 && !e.stillBefore(c.LeaseExpiry.Add(e.h.TTL)) {
		return
	}
	if next.Fence != c.Fence+1 {
		t.Fatalf("claim just before lease expiry + ttl: fence %d, want %d (the record must be kept)", next.Fence, c.Fence+1)
	}
	e.complete(c, false)
	e.complete(next, true)
}

// releasedOutlives: a released record expires at release time + ttl.
func releasedOutlives(t *testing.T, e *env) {
	k := e.key()
	c := e.won(k, e.long())
	e.pass(e.short())
	before := e.h.Now()
	e.release(c)
	if !e.justBefore(before.Add(e.h.TTL)) {
		return
	}
	e.purgeIfAble()
	next := e.won(k, e.long())
	if next.Fence != c.Fence+2 && !e.stillBefore(before.Add(e.h.TTL)) {
		return
	}
	if next.Fence != c.Fence+2 {
		t.Fatalf("claim just before release + ttl: fence %d, want %d (the record must be kept)", next.Fence, c.Fence+2)
	}
	e.complete(c, false)
	e.complete(next, true)
}

// extendedOutlives: an extended record expires at its new lease expiry +
// ttl, not at the old one's.
func extendedOutlives(t *testing.T, e *env) {
	x := e.extender()
	k := e.key()
	c := e.won(k, e.short())
	ext, err := x.Extend(e.ctx, c, 4*e.h.Step)
	if err != nil {
		t.Fatalf("Extend: %v", err)
	}
	if !e.justBefore(ext.LeaseExpiry.Add(e.h.TTL)) {
		return
	}
	e.purgeIfAble()
	next := e.won(k, e.long())
	if next.Fence != c.Fence+1 && !e.stillBefore(ext.LeaseExpiry.Add(e.h.TTL)) {
		return
	}
	if next.Fence != c.Fence+1 {
		t.Fatalf("claim just before the extended lease expiry + ttl: fence %d, want %d (the record must be kept)", next.Fence, c.Fence+1)
	}
	e.complete(ext, false)
	e.complete(next, true)
}

// lostClaim loses the reply of a Claim on a fresh, a lapsed and an expired
// Done key. The call either recognises its own claim (Won, one fence step)
// or returns an error; it never answers HeldByOther or AlreadyDone about
// its own write. After an error the key is consistent: either the lost
// claim landed (the key is held until its lease lapses, then the fence
// moves on from it) or it did not (the next claim takes the fence it would
// have had).
func lostClaim(t *testing.T, e *env) {
	f := e.faults()
	fresh, lapsed, expired := e.key(), e.key(), e.key()
	l := e.won(lapsed, e.short())
	d := e.won(expired, e.long())
	e.complete(d, true)
	e.pass(e.h.TTL)
	lease := 3 * e.h.Step
	for _, tc := range []struct {
		key    string
		fences []int64 // the fences the lost claim may take: kept, or reaped
	}{
		{fresh, []int64{1}},
		{lapsed, []int64{l.Fence + 1, 1}},
		{expired, []int64{d.Fence + 1, 1}},
	} {
		k := tc.key
		allowed := func(fence int64, step int64) bool {
			for _, a := range tc.fences {
				if fence == a+step {
					return true
				}
			}
			return false
		}
		f.LoseNextReply()
		sent := e.h.Now()
		r, err := e.h.Backend.Claim(e.ctx, k, lease)
		if err == nil {
			if r.Outcome != store.Won {
				t.Fatalf("Claim(%q) whose reply was lost answered %v: it may have won, so it must answer won (its own claim recognised) or an error", k, r.Outcome)
			}
			if !allowed(r.Claim.Fence, 0) {
				t.Fatalf("Claim(%q) recognised its own claim with fence %d, want one of %v (one step, not two)", k, r.Claim.Fence, tc.fences)
			}
			e.complete(r.Claim, true)
			e.expect(k, store.AlreadyDone)
			continue
		}
		t.Logf("Claim(%q) with a lost reply: %v", k, err)
		before := e.h.Now()
		r = e.claim(k, e.long())
		switch r.Outcome {
		case store.Won:
			// The lost claim never landed, or it landed (no sooner than
			// sent) and its lease lapsed before this claim was judged: on
			// a machine slower than the lease, the fence moved on from it.
			lapsed := !r.Claim.LeaseExpiry.Add(-e.long()).Before(sent.Add(lease - tolerance))
			if !allowed(r.Claim.Fence, 0) && !(lapsed && allowed(r.Claim.Fence, 1)) {
				if lapsed {
					t.Fatalf("Claim(%q) after a lost claim whose lease may have lapsed: fence %d, want one of %v, or one of them plus 1", k, r.Claim.Fence, tc.fences)
				}
				t.Fatalf("Claim(%q) after a lost claim that did not land: fence %d, want one of %v", k, r.Claim.Fence, tc.fences)
			}
		case store.HeldByOther: // it landed: it holds the key until its lease lapses
			if !r.Until.IsZero() && r.Until.After(before.Add(lease+tolerance)) {
				t.Fatalf("HeldByOther.Until = %v, after anything the lost claim (lease %v) could hold", r.Until, lease)
			}
			e.pass(lease)
			r = e.claim(k, e.long())
			if r.Outcome != store.Won || !allowed(r.Claim.Fence, 1) {
				t.Fatalf("Claim(%q) after the lost claim's lease: %v fence %d, want won with one of %v plus 1", k, r.Outcome, r.Claim.Fence, tc.fences)
			}
		default:
			t.Fatalf("Claim(%q) after a lost claim: %v, want won or held by other", k, r.Outcome)
		}
		e.complete(r.Claim, true)
		e.expect(k, store.AlreadyDone)
	}
}

// retries calls op until it returns no error, at most a few times: after
// a fault the backend may need a new connection.
func (e *env) retries(what string, op func() error) {
	e.t.Helper()
	var err error
	for range 5 {
		if err = op(); err == nil {
			return
		}
		e.t.Logf("%s: %v (retrying)", what, err)
	}
	e.t.Fatalf("%s kept failing: %v", what, err)
}

// lostComplete: a Complete whose reply was lost is retried; the retry finds
// the record Done with the caller's fence and answers true.
func lostComplete(t *testing.T, e *env) {
	f := e.faults()
	k := e.key()
	c := e.won(k, e.long())
	f.LoseNextReply()
	// The completion took effect at or after this instant: expect's
	// real-time guard (a case slower than the ttl concludes nothing) needs
	// it, as for every other completion.
	before := e.h.Now()
	ok, err := e.h.Backend.Complete(e.ctx, c)
	t.Logf("Complete with a lost reply: %v, %v", ok, err)
	if err == nil {
		if !ok {
			t.Fatalf("Complete of the current claim answered false after a lost reply")
		}
		e.done[k] = completion{c.Fence, before}
		// True is the caller's licence to ack: the key is done now, with
		// no retry to help it.
		e.expect(k, store.AlreadyDone)
	}
	e.retries("retried Complete", func() error {
		ok, err := e.h.Backend.Complete(e.ctx, c)
		if err == nil && !ok {
			t.Fatalf("retried Complete answered false: the record is Done with this fence, or still Claimed with it")
		}
		return err
	})
	if _, seen := e.done[k]; !seen {
		e.done[k] = completion{c.Fence, before}
	}
	e.expect(k, store.AlreadyDone)
	e.complete(c, true)
}

// lostRelease: a Release whose reply was lost is retried; the fence rises
// once, and the key is reclaimable at once.
func lostRelease(t *testing.T, e *env) {
	f := e.faults()
	k := e.key()
	c := e.won(k, e.long())
	f.LoseNextReply()
	err := e.h.Backend.Release(e.ctx, c)
	t.Logf("Release with a lost reply: %v", err)
	e.retries("retried Release", func() error { return e.h.Backend.Release(e.ctx, c) })
	next := e.won(k, e.long())
	if next.Fence != c.Fence+2 {
		t.Fatalf("claim after a retried release: fence %d, want %d (release +1 once, reclaim +1)", next.Fence, c.Fence+2)
	}
	e.complete(c, false)
	e.expect(k, store.HeldByOther)
	e.complete(next, true)
}

// keyLog is what the racers of cutMidCall saw of one key. Instants are
// read from the backend's clock (Harness.Now).
type keyLog struct {
	mu sync.Mutex
	// won maps each fence won to the window of the first call recorded
	// as winning it.
	won map[int64]window
	// lastWin is when the latest winning call started: no record of the
	// key can expire (and be reaped, restarting the fence) before lastWin
	// + ttl.
	lastWin  time.Time
	maxFence int64
	// done is set once a Complete answered true: doneSeq orders it against
	// the calls, doneStart is when the first attempt of that Complete
	// started (an attempt that failed may have landed), doneEnd when the
	// one that answered true returned.
	done      bool
	doneSeq   int64
	doneStart time.Time
	doneEnd   time.Time
	doneFence int64
	attempted bool // some Complete was sent
}

// window is when a call ran, on the backend's clock: it took effect at
// some instant between start and end.
type window struct{ start, end time.Time }

// apart reports whether one of two calls can have taken effect at least d
// after the other: it cannot when each ended before the other started + d.
func apart(a, b window, d time.Duration) bool {
	return !a.end.Before(b.start.Add(d)) || !b.end.Before(a.start.Add(d))
}

// cutMidCall runs claim/complete/release loops on a few keys while the
// connections are cut again and again. Every call returns (an answer or an
// error, within a generous deadline); within a ttl, no fence is won twice,
// at most one claim completes a key and no claim that starts after a
// completion wins; and once the faults stop and the leases lapse, every key
// converges: done, or won by a fence above every fence won before.
func cutMidCall(t *testing.T, e *env) {
	f := e.faults()
	const workers, nkeys = 4, 6
	keys := make([]string, nkeys)
	logs := make([]*keyLog, nkeys)
	for i := range keys {
		keys[i] = e.key()
		logs[i] = &keyLog{won: map[int64]window{}}
	}
	ttl := e.h.TTL
	lease := 2 * e.h.Step
	span := ttl / 4
	if e.h.Advance != nil {
		span = 300 * time.Millisecond
	}
	var (
		seq        atomic.Int64
		calls, bad atomic.Int64
		mu         sync.Mutex
		violations []string
		stop       = make(chan struct{})
		wg         sync.WaitGroup
	)
	violate := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		violations = append(violations, fmt.Sprintf(format, args...))
	}
	// Each call gets a deadline far beyond its normal time: a call that
	// outlives it hung on a cut connection.
	call := func() (context.Context, func()) {
		calls.Add(1)
		return context.WithTimeout(e.ctx, 30*time.Second)
	}
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for {
				select {
				case <-stop:
					return
				default:
				}
				i := rng.IntN(nkeys)
				k, lg := keys[i], logs[i]
				s, start := seq.Add(1), e.h.Now()
				ctx, cancel := call()
				r, err := e.h.Backend.Claim(ctx, k, lease)
				cancel()
				if err != nil {
					bad.Add(1)
					if errors.Is(err, context.DeadlineExceeded) {
						violate("Claim(%q) hung past its deadline", k)
					}
					continue
				}
				if r.Outcome != store.Won {
					if r.Outcome != store.HeldByOther && r.Outcome != store.AlreadyDone {
						violate("Claim(%q) answered outcome %v without an error", k, r.Outcome)
					}
					continue
				}
				end := e.h.Now()
				c := r.Claim
				lg.mu.Lock()
				// A fence repeats only if the record was reaped in between,
				// which takes a ttl after the earlier win, whichever of the
				// two calls was recorded first (a goroutine may record its
				// win late).
				if first, ok := lg.won[c.Fence]; ok && !apart(first, window{start, end}, ttl) {
					violate("Claim(%q): fence %d won twice within the ttl", k, c.Fence)
				}
				// Winning a done key takes its ttl after the completion.
				if lg.done && s > lg.doneSeq && end.Before(lg.doneStart.Add(ttl)) {
					violate("Claim(%q) won fence %d within the ttl of the completion of fence %d", k, c.Fence, lg.doneFence)
				}
				if _, ok := lg.won[c.Fence]; !ok {
					lg.won[c.Fence] = window{start, end}
				}
				lg.lastWin = start
				lg.maxFence = max(lg.maxFence, c.Fence)
				lg.mu.Unlock()
				switch rng.IntN(5) {
				case 0, 1:
					lg.mu.Lock()
					lg.attempted = true
					lg.mu.Unlock()
					cstart := e.h.Now()
					for range 5 {
						ctx, cancel := call()
						ok, err := e.h.Backend.Complete(ctx, c)
						cancel()
						if err != nil {
							bad.Add(1)
							continue
						}
						if ok {
							cend := e.h.Now()
							lg.mu.Lock()
							// Whichever took effect first, the other took
							// effect a ttl later at the soonest.
							if lg.done && lg.doneFence != c.Fence && !apart(window{lg.doneStart, lg.doneEnd}, window{cstart, cend}, ttl) {
								violate("Complete(%q): fences %d and %d both completed within the ttl", k, lg.doneFence, c.Fence)
							}
							if !lg.done || lg.doneFence != c.Fence {
								lg.done, lg.doneSeq, lg.doneStart, lg.doneEnd, lg.doneFence = true, seq.Add(1), cstart, cend, c.Fence
							}
							lg.mu.Unlock()
						}
						break
					}
				case 2, 3:
					for range 5 {
						ctx, cancel := call()
						err := e.h.Backend.Release(ctx, c)
						cancel()
						if err == nil {
							break
						}
						bad.Add(1)
					}
				default: // abandon the claim: its lease lapses
				}
			}
		})
	}
	cuts := 0
	for deadline := time.Now().Add(span); time.Now().Before(deadline); cuts++ {
		time.Sleep(span / 10)
		f.CutConnections()
		if e.h.Advance != nil {
			e.h.Advance(e.h.Step / 4)
		}
	}
	close(stop)
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-time.After(2 * time.Minute):
		t.Fatal("calls still running two minutes after the cuts stopped")
	}
	t.Logf("%d calls, %d errors, %d cuts", calls.Load(), bad.Load(), cuts)
	for _, v := range violations {
		t.Error(v)
	}

	// The faults have stopped; once every lease lapses, every key settles.
	// A first call may still meet a connection that the cuts left broken:
	// it may fail, and if its claim landed, hold the key for its lease.
	e.pass(lease)
	for i, k := range keys {
		lg := logs[i]
		var r store.Result
		for attempt, failed := 0, false; ; attempt++ {
			var err error
			r, err = e.h.Backend.Claim(e.ctx, k, lease)
			if err == nil && (r.Outcome != store.HeldByOther || !failed) {
				break
			}
			if attempt == 5 {
				t.Fatalf("key %q did not settle after the faults stopped: %v, %v", k, r.Outcome, err)
			}
			if err != nil {
				t.Logf("Claim(%q) after the faults: %v (retrying)", k, err)
				failed = true
			}
			e.pass(lease)
		}
		now := e.h.Now()
		switch r.Outcome {
		case store.Won:
			if lg.done && now.Before(lg.doneStart.Add(ttl)) {
				t.Errorf("key %q: won at fence %d within the ttl of the completion of fence %d", k, r.Claim.Fence, lg.doneFence)
			}
			if r.Claim.Fence <= lg.maxFence && now.Before(lg.lastWin.Add(ttl)) {
				t.Errorf("key %q: won at fence %d, not above fence %d won before", k, r.Claim.Fence, lg.maxFence)
			}
			sent := e.h.Now()
			e.retries("Complete after the faults", func() error {
				ok, err := e.h.Backend.Complete(e.ctx, r.Claim)
				if err == nil && !ok {
					t.Fatalf("key %q: Complete of the settling claim answered false", k)
				}
				return err
			})
			// For expect's guard: a machine slower than the ttl proves
			// nothing about a key it expects still done.
			e.done[k] = completion{r.Claim.Fence, sent}
			e.expect(k, store.AlreadyDone)
		case store.AlreadyDone:
			if !lg.attempted {
				t.Errorf("key %q is done, but no Complete was ever sent", k)
			}
		default:
			t.Errorf("key %q: %v after every lease lapsed", k, r.Outcome)
		}
	}
}

// claimFromBeforeDeletion: once a record's expires-at has passed, the
// backend may delete it, and the next Claim starts a fresh record at fence
// 1, the fence an old holder may also carry. The claim token tells them
// apart: the old claim must change nothing on the new record.
// lookalikeTokens: a claim with the holder's key, fence and lease but a
// token that merely resembles the holder's (the holder's with a suffix, as
// a record format that ends the token at a separator would read it, a
// prefix of it, the same in upper case) completes, releases and extends nothing, on
// a claimed record and on a done one. A backend must compare the whole
// token, byte for byte.
func lookalikeTokens(t *testing.T, e *env) {
	k := e.key()
	holder := e.won(k, e.long())
	tok := holder.Token
	lookalikes := []string{tok + ",", tok + ",fp", tok + ",,x", tok + " ", tok + "0", tok[:len(tok)-1], strings.ToUpper(tok) + "X"}
	if up := strings.ToUpper(tok); up != tok {
		lookalikes = append(lookalikes, up) // a collation that ignores case
	}
	forged := func(token string) store.Claim {
		c := holder
		c.Token, c.Rev = token, 0
		return c
	}
	// touch makes every call a forged claim can make but Extend, each of
	// which must change nothing.
	touch := func(c store.Claim) {
		t.Helper()
		e.complete(c, false)
		if f, ok := e.h.Backend.(store.Fingerprinter); ok {
			e.completeFP(f, c, "lookalike", false)
		}
		e.release(c)
	}
	for _, tk := range lookalikes {
		c := forged(tk)
		touch(c)
		if x, ok := e.h.Backend.(store.Extender); ok {
			if _, err := x.Extend(e.ctx, c, e.long()); !errors.Is(err, store.ErrLost) {
				t.Errorf("Extend with the token %q of a record held by %q: err = %v, want ErrLost", tk, tok, err)
			}
		}
		if r := e.expect(k, store.HeldByOther); !sameInstant(r.Until, holder.LeaseExpiry) {
			t.Fatalf("after calls with the token %q: the holder's lease ends at %v, want %v", tk, r.Until, holder.LeaseExpiry)
		}
	}
	e.complete(holder, true)
	for _, tk := range lookalikes {
		touch(forged(tk))
	}
	e.expect(k, store.AlreadyDone)
}

func claimFromBeforeDeletion(t *testing.T, e *env) {
	k := e.key()
	old := e.won(k, e.short())
	e.pass(e.short() + e.h.TTL)
	if p, ok := e.h.Backend.(store.Purger); ok {
		if _, err := p.PurgeExpired(e.ctx, 0); err != nil {
			t.Fatalf("PurgeExpired: %v", err)
		}
	}
	fresh := e.won(k, e.long())
	if fresh.Fence != 1 {
		t.Logf("the record was kept (fence %d): the fence alone tells the claims apart", fresh.Fence)
	}
	e.complete(old, false)
	if f, ok := e.h.Backend.(store.Fingerprinter); ok {
		e.completeFP(f, old, "from before the deletion", false)
	}
	e.release(old)
	if x, ok := e.h.Backend.(store.Extender); ok {
		if _, err := x.Extend(e.ctx, old, e.long()); !errors.Is(err, store.ErrLost) {
			t.Errorf("Extend of a claim from before the record was deleted: err = %v, want ErrLost", err)
		}
	}
	e.expect(k, store.HeldByOther)
	e.complete(fresh, true)
	e.expect(k, store.AlreadyDone)
}
