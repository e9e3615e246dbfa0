// Package storetest is the conformance suite for store.Backend
// implementations. Every backend in this module runs it, and so can a third
// party's:
//
//	func TestContract(t *testing.T) {
//		storetest.Run(t, func(t *testing.T) storetest.Harness {
//			clock := fake.NewClock(time.Now())
//			return storetest.Harness{
//				Backend: fake.New(fake.WithClock(clock.Now)),
//				TTL:     store.DefaultTTL,
//				Advance: clock.Advance,
//				Now:     clock.Now,
//			}
//		})
//	}
//
// Each case is a subtest named after the rule it checks, runs in parallel on
// a fresh Harness with keys of its own, and can be selected with -run (for
// example -run 'TestContract/zombie').
package storetest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
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
	// every networked backend should provide it.
	Faults Faults
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
	{"keys_are_stored_verbatim_and_kept_apart", keysVerbatim},
	{"invalid_keys_are_refused", invalidKeys},
	{"non_positive_leases_are_refused", invalidLease},
	{"a_cancelled_context_fails_and_changes_nothing", cancelledContext},
	{"extend_renews_only_the_current_claim", extend},
	{"purge_removes_only_expired_records", purge},
}

type env struct {
	t    *testing.T
	h    Harness
	ctx  context.Context
	base string
	n    int
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
	r, err := e.h.Backend.Claim(e.ctx, key, lease)
	if err != nil {
		e.t.Fatalf("Claim(%q, %v): %v", key, lease, err)
	}
	return r
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
		e.t.Fatalf("Claim(%q): outcome %v, want %v", key, r.Outcome, want)
	}
	return r
}

func (e *env) complete(c store.Claim, want bool) {
	e.t.Helper()
	ok, err := e.h.Backend.Complete(e.ctx, c)
	if err != nil {
		e.t.Fatalf("Complete(%q, fence %d): %v", c.Key, c.Fence, err)
	}
	if ok != want {
		e.t.Fatalf("Complete(%q, fence %d) = %v, want %v", c.Key, c.Fence, ok, want)
	}
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
	e.complete(c, true)
	e.pass(e.h.TTL / 2)
	r := e.expect(k, store.AlreadyDone)
	if !r.Until.IsZero() && !r.Until.After(c.LeaseExpiry.Add(-e.long())) {
		t.Errorf("AlreadyDone.Until = %v is not after the claim", r.Until)
	}
	// A mutex-style claim with a short lease is refused as well.
	if r := e.claim(k, e.short()); r.Outcome != store.AlreadyDone {
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
	if next.Fence <= c.Fence {
		t.Fatalf("fence after release = %d, want more than %d", next.Fence, c.Fence)
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
			t.Fatalf("racer got %v", r.Outcome)
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
	keys := []string{
		p + "orders:po-123",
		p + "ünïcødé/ключ/鍵/🔑",
		p + "a/b/../c//d",
		p + "with spaces\tand\ttabs\nand newline",
		p + "\x01\x02\x7f\x80\xfe\xff",
		p + "{hash}tag{x}",
		p + "quote' \"; DROP TABLE records; --",
		p + `%s %d \ \\ *?[]`,
		p + "Case",
		p + "case",
		p + "case ",
		p + strings.Repeat("k", store.MaxKeyLen-len(p)),
	}
	claims := make([]store.Claim, len(keys))
	for i, k := range keys {
		claims[i] = e.won(k, e.long())
		if claims[i].Fence != 1 {
			t.Fatalf("key %q: fence %d, want 1 (keys collided)", k, claims[i].Fence)
		}
	}
	for i, c := range claims {
		if i%2 == 0 {
			e.complete(c, true)
		}
	}
	for i, k := range keys {
		want := store.HeldByOther
		if i%2 == 0 {
			want = store.AlreadyDone
		}
		e.expect(k, want)
	}
}

func invalidKeys(t *testing.T, e *env) {
	for _, k := range []string{"", "nul\x00byte", strings.Repeat("x", store.MaxKeyLen+1)} {
		_, err := e.h.Backend.Claim(e.ctx, k, e.long())
		if !errors.Is(err, store.ErrInvalidKey) {
			t.Errorf("Claim(%.20q...): err = %v, want ErrInvalidKey", k, err)
		}
	}
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
	e.expect(k, store.HeldByOther)
	e.complete(c, true)
}

func extend(t *testing.T, e *env) {
	x, ok := e.h.Backend.(store.Extender)
	if !ok {
		t.Logf("%T does not implement store.Extender; nothing to check", e.h.Backend)
		return
	}
	k := e.key()
	c := e.won(k, e.short())
	ext, err := x.Extend(e.ctx, c, e.long())
	if err != nil {
		t.Fatalf("Extend: %v", err)
	}
	if ext.Fence != c.Fence || !ext.LeaseExpiry.After(c.LeaseExpiry) {
		t.Fatalf("Extend returned fence %d expiry %v; want fence %d, expiry after %v",
			ext.Fence, ext.LeaseExpiry, c.Fence, c.LeaseExpiry)
	}
	e.pass(e.short())
	e.expect(k, store.HeldByOther)
	if _, err := x.Extend(e.ctx, c, 0); !errors.Is(err, store.ErrInvalidLease) {
		t.Errorf("Extend(lease 0): err = %v, want ErrInvalidLease", err)
	}
	e.complete(c, true)
	if _, err := x.Extend(e.ctx, c, e.long()); !errors.Is(err, store.ErrLost) {
		t.Errorf("Extend of a done claim: err = %v, want ErrLost", err)
	}

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
}

func purge(t *testing.T, e *env) {
	p, ok := e.h.Backend.(store.Purger)
	if !ok {
		t.Logf("%T does not implement store.Purger; nothing to check", e.h.Backend)
		return
	}
	expired, done, held := e.key(), e.key(), e.key()
	old := e.won(expired, e.long())
	e.complete(old, true)
	e.pass(e.h.TTL)
	d := e.won(done, e.long())
	e.complete(d, true)
	e.won(held, e.short())

	n, err := p.PurgeExpired(e.ctx, 0)
	if err != nil {
		t.Fatalf("PurgeExpired: %v", err)
	}
	if n < 1 {
		t.Fatalf("PurgeExpired removed %d records, want at least the expired one", n)
	}
	if c := e.won(expired, e.long()); c.Fence != 1 {
		t.Fatalf("expired key after purge: fence %d, want 1 (a fresh record)", c.Fence)
	}
	e.expect(done, store.AlreadyDone)
	e.expect(held, store.HeldByOther)
}
