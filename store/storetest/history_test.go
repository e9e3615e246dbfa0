package storetest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The history check passes the fake on a clock it drives, with 10k calls,
// and the run really lets leases lapse and ttls end.
func TestHistoryFakeAdvance(t *testing.T) {
	t.Parallel()
	clock := fake.NewClock(time.Date(2026, 3, 29, 0, 30, 0, 0, time.UTC))
	h := newEnv(t, Harness{
		Backend: fake.New(fake.WithClock(clock.Now)),
		TTL:     store.DefaultTTL,
		Advance: clock.Advance,
		Now:     clock.Now,
	}).h
	st := checkHistory(t, h, HistoryOptions{})
	requireExercised(t, st, 10000, false)
}

// The same in real time, the way a server's clock runs.
func TestHistoryFakeRealTime(t *testing.T) {
	t.Parallel()
	// Through the exported entry point, as a third party would call it.
	CheckHistory(t, Harness{Backend: fake.New(fake.WithTTL(time.Second)), TTL: time.Second, Step: 20 * time.Millisecond}, HistoryOptions{})
}

// Calls whose replies are lost, or that fail before or after they took
// effect, are recorded with an unknown outcome, and a correct backend still
// passes.
func TestHistoryFakeWithLostReplies(t *testing.T) {
	t.Parallel()
	clock := fake.NewClock(time.Date(2026, 10, 25, 0, 30, 0, 0, time.UTC))
	l := &lossy{Store: fake.New(fake.WithClock(clock.Now))}
	h := newEnv(t, Harness{Backend: l, TTL: store.DefaultTTL, Advance: clock.Advance, Now: clock.Now, Faults: l}).h
	st := checkHistory(t, h, HistoryOptions{FaultRate: 0.03})
	requireExercised(t, st, 10000, true)
}

// The reference backend of this file, without a bug, passes too (it is the
// baseline the broken ones below differ from by one bug each).
func TestHistoryCorrectReference(t *testing.T) {
	t.Parallel()
	b, h := newBroken(t, "")
	st := checkHistory(t, h, HistoryOptions{Ops: 6000, FaultRate: 0.03})
	requireExercised(t, st, 6000, true)
	if b.lost.Load() == 0 {
		t.Error("no reply was lost")
	}
}

func requireExercised(t *testing.T, st historyStats, ops int, faults bool) {
	t.Helper()
	t.Logf("%d calls: run %v, check %v; %s", st.calls, st.run, st.check, st)
	if st.result != porcupine.Ok {
		t.Fatalf("result %v", st.result)
	}
	if st.calls < ops {
		t.Errorf("%d calls, want at least %d", st.calls, ops)
	}
	for name, n := range map[string]int{
		"won": st.won, "held by other": st.held, "already done": st.done, "already done with a fingerprint": st.doneWithFP,
		"complete true": st.completed, "complete false": st.refused, "release": st.releases,
		"extend": st.extended, "extend lost": st.lostExt, "zombie call": st.zombies,
		"reclaim after a lapsed lease": st.lapses, "reclaim after the ttl": st.ttlEnds,
	} {
		if n == 0 {
			t.Errorf("the run had no %s", name)
		}
	}
	if faults && st.unknown == 0 {
		t.Error("the run had no call with an unknown outcome")
	}
}

// Every broken backend is flagged, with a counterexample and a
// visualization file.
func TestHistoryFlagsBrokenBackends(t *testing.T) {
	t.Parallel()
	bugs := []string{
		"two claims win a live lease",
		"already done after the ttl",
		"the fence goes down when a lease lapses",
		"complete ignores the fence",
		"held by other after its own lost win",
		"the lease expiry is reported a step late",
		"the ttl runs from the claim, not the completion",
		"release deletes the record",
		"extend ignores the fence",
		"extend answers lost for the current claim",
		"purge deletes records whose lease lapsed",
		"held by other until past the lease",
		"claims report a fingerprint from the record's earlier life",
		"a zombie's complete stores its fingerprint",
		"complete, release and extend match the fence but not the token",
	}
	html := regexp.MustCompile(`\S+storetest-history-\S+\.html`)
	for _, bug := range bugs {
		t.Run(strings.ReplaceAll(bug, " ", "_"), func(t *testing.T) {
			t.Parallel()
			o := HistoryOptions{Ops: 4000, Keys: 20}
			if strings.Contains(bug, "earlier life") {
				// Purges delete most records once their ttl ends, and a
				// deleted record has no earlier life to leak from.
				o.PurgeEvery = -1
			}
			reaps := false
			if strings.Contains(bug, "not the token") {
				// No purges: the backend deletes expired records by
				// itself, the moment they expire, as Redis does. The
				// bug shows only when a zombie's fence meets the same
				// fence in the record's next life, which one history
				// of 4000 calls in five missed: this one makes more.
				o.PurgeEvery = -1
				o.Ops = 10000
				reaps = true
			}
			// A mutant must be flagged by one of three histories (each
			// with its own seed): the clients race, so a single run may
			// miss a bug that needs a rare interleaving.
			var rec *recorder
			for range 3 {
				b, h := newBroken(t, bug)
				b.reaps = reaps
				rec = &recorder{T: t}
				checkHistory(rec, h, o)
				if strings.Contains(strings.Join(rec.errors, "\n"), "NOT LINEARIZABLE") {
					break
				}
			}
			msg := strings.Join(rec.errors, "\n")
			if !strings.Contains(msg, "NOT LINEARIZABLE") {
				t.Fatalf("the checker did not flag a backend where %s; it reported: %q", bug, msg)
			}
			if !strings.Contains(msg, "=> client") {
				t.Errorf("the counterexample does not point at the failing call:\n%s", msg)
			}
			path := html.FindString(msg)
			if fi, err := os.Stat(path); err != nil || fi.Size() == 0 {
				t.Errorf("no visualization file %q: %v", path, err)
			} else {
				os.Remove(path)
			}
			if testing.Verbose() {
				t.Log(msg)
			}
		})
	}
}

// unknownWithoutFault is the broken backend's bug that only the rule
// "no unknown outcome without a fault" catches: one Complete in 50 applies
// and then answers an error, as a backend that takes an abort or a
// refusal for a lost reply does. Its history stays linearizable (an
// unknown outcome may have applied).
const unknownWithoutFault = "complete answers an error after it applied, with no fault injected"

// With no fault injected, a backend that answers a call with an error
// (an unknown outcome) is flagged, and the same backend without the bug
// passes.
func TestHistoryFlagsUnknownOutcomesWithoutFaults(t *testing.T) {
	t.Parallel()
	for _, bug := range []string{"", unknownWithoutFault} {
		t.Run(strings.ReplaceAll(cmp.Or(bug, "no bug"), " ", "_"), func(t *testing.T) {
			t.Parallel()
			b, h := newBroken(t, bug)
			rec := &recorder{T: t}
			st := checkHistory(rec, h, HistoryOptions{Ops: 4000, Keys: 20, FaultRate: -1})
			msg := strings.Join(rec.errors, "\n")
			if b.lost.Load() != 0 {
				t.Fatalf("%d replies were lost with faults off", b.lost.Load())
			}
			if bug == "" {
				if msg != "" || st.unknown != 0 {
					t.Fatalf("the correct backend was flagged (%d unknown outcomes): %s", st.unknown, msg)
				}
				return
			}
			if st.result != porcupine.Ok {
				t.Errorf("the history is %v, want linearizable: only the new rule should flag this bug", st.result)
			}
			if !strings.Contains(msg, "UNKNOWN OUTCOME WITHOUT A FAULT") || !strings.Contains(msg, "Complete") || !strings.Contains(msg, errLost.Error()) {
				t.Fatalf("the checker did not flag a backend where %s (%d unknown outcomes); it reported: %q", bug, st.unknown, msg)
			}
		})
	}
}

// recorder keeps what a history run reports instead of failing the test.
type recorder struct {
	*testing.T
	mu     sync.Mutex
	errors []string
}

func (r *recorder) Errorf(format string, args ...any) { r.Error(fmt.Sprintf(format, args...)) }

func (r *recorder) Error(args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errors = append(r.errors, fmt.Sprint(args...))
}

// lossy is the fake behind a network that loses replies and cuts calls: a
// lost reply comes after the call took effect, a cut call fails before or
// after it took effect.
type lossy struct {
	*fake.Store
	lose atomic.Bool
	cut  atomic.Int32
}

var errLost = errors.New("lossy: reply lost")

func (l *lossy) LoseNextReply()  { l.lose.Store(true) }
func (l *lossy) CutConnections() { l.cut.Store(3) }

// fault reports whether the next call fails before it takes effect, or
// after.
func (l *lossy) fault() (before, after bool) {
	if l.lose.CompareAndSwap(true, false) {
		return false, true
	}
	if l.cut.Add(-1) >= 0 {
		if rand.IntN(2) == 0 {
			return true, false
		}
		return false, true
	}
	return false, false
}

func (l *lossy) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	before, after := l.fault()
	if before {
		return store.Result{}, errLost
	}
	r, err := l.Store.Claim(ctx, key, lease)
	if after {
		return store.Result{}, errLost
	}
	return r, err
}

func (l *lossy) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return l.CompleteFingerprint(ctx, c, "")
}

func (l *lossy) CompleteFingerprint(ctx context.Context, c store.Claim, fp string) (bool, error) {
	before, after := l.fault()
	if before {
		return false, errLost
	}
	ok, err := l.Store.CompleteFingerprint(ctx, c, fp)
	if after {
		return false, errLost
	}
	return ok, err
}

func (l *lossy) Release(ctx context.Context, c store.Claim) error {
	before, after := l.fault()
	if before {
		return errLost
	}
	err := l.Store.Release(ctx, c)
	if after {
		return errLost
	}
	return err
}

func (l *lossy) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	before, after := l.fault()
	if before {
		return c, errLost
	}
	ext, err := l.Store.Extend(ctx, c, lease)
	if after {
		return c, errLost
	}
	return ext, err
}

// broken is a small backend with at most one deliberate bug, on a clock the
// test drives. It loses the reply of a call after applying it when asked
// (it is its own Faults).
type broken struct {
	bug   string
	clock *fake.Clock
	step  time.Duration
	ttl   time.Duration

	mu   sync.Mutex
	recs map[string]*brec
	n    int
	rng  *rand.Rand

	lose atomic.Bool
	lost atomic.Int32

	// reaps makes the backend delete every record whose expires-at has
	// passed before each call, as a store with its own expiry does.
	reaps bool
}

// reap deletes the expired records when the backend reaps, with b.mu held.
func (b *broken) reap() {
	if !b.reaps {
		return
	}
	now := b.clock.Now()
	for k, r := range b.recs {
		if !now.Before(r.until) {
			delete(b.recs, k)
		}
	}
}

type brec struct {
	done         bool
	fence        int64
	token        string
	claimedAt    time.Time
	lease, until time.Time // until: expires-at
	fp           string
}

func newBroken(t *testing.T, bug string) (*broken, Harness) {
	clock := fake.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	b := &broken{bug: bug, clock: clock, step: time.Minute, ttl: time.Hour, recs: map[string]*brec{},
		rng: rand.New(rand.NewPCG(1, 2))}
	return b, newEnv(t, Harness{Backend: b, TTL: b.ttl, Advance: clock.Advance, Now: clock.Now, Step: b.step, Faults: b}).h
}

func (b *broken) LoseNextReply()  { b.lose.Store(true) }
func (b *broken) CutConnections() {}

// replyLost reports whether this call's reply is to be lost.
func (b *broken) replyLost() bool {
	if b.lose.CompareAndSwap(true, false) {
		b.lost.Add(1)
		return true
	}
	return false
}

func (b *broken) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	if err := ctx.Err(); err != nil {
		return store.Result{}, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reap()
	now := b.clock.Now()
	r, ok := b.recs[key]
	if ok && b.bug == "the fence goes down when a lease lapses" && !r.done && !now.Before(r.lease) {
		ok = false
	}
	switch {
	case !ok:
		r = &brec{}
		b.recs[key] = r
	case r.done && (now.Before(r.until) || b.bug == "already done after the ttl" && now.Before(r.until.Add(b.ttl/4))):
		return store.Result{Outcome: store.AlreadyDone, Until: r.until, Fingerprint: r.fp}, nil
	case !r.done && now.Before(r.lease) && b.bug == "two claims win a live lease" && b.rng.IntN(20) == 0:
		// steal it
	case !r.done && now.Before(r.lease):
		res := store.Result{Outcome: store.HeldByOther, Until: r.lease}
		if b.bug == "claims report a fingerprint from the record's earlier life" {
			res.Fingerprint = r.fp
		}
		return res, nil
	case !r.done && now.Before(r.lease.Add(b.step)) && b.bug == "held by other until past the lease":
		return store.Result{Outcome: store.HeldByOther, Until: r.lease}, nil
	}
	b.n++
	old := r.fp
	*r = brec{fence: r.fence + 1, token: fmt.Sprint("b", b.n), claimedAt: now, lease: now.Add(lease), until: now.Add(lease + b.ttl)}
	if b.bug == "claims report a fingerprint from the record's earlier life" {
		r.fp = old
	}
	c := store.Claim{Key: key, Fence: r.fence, Token: r.token, LeaseExpiry: r.lease}
	if b.bug == "the lease expiry is reported a step late" && b.rng.IntN(20) == 0 {
		c.LeaseExpiry = c.LeaseExpiry.Add(b.step)
	}
	if b.replyLost() {
		if b.bug == "held by other after its own lost win" {
			// A retry that does not recognise its own claim.
			return store.Result{Outcome: store.HeldByOther, Until: r.lease}, nil
		}
		return store.Result{}, errLost
	}
	res := store.Result{Outcome: store.Won, Claim: c}
	if b.bug == "claims report a fingerprint from the record's earlier life" {
		res.Fingerprint = r.fp
	}
	return res, nil
}

// owns reports whether claim c is the one that won record r: its fence and
// its token match (its fence alone, for the backend with that bug).
func (b *broken) owns(r *brec, c store.Claim) bool {
	return r.fence == c.Fence && (r.token == c.Token || b.bug == "complete, release and extend match the fence but not the token")
}

func (b *broken) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return b.CompleteFingerprint(ctx, c, "")
}

func (b *broken) CompleteFingerprint(ctx context.Context, c store.Claim, fp string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reap()
	r, ok := b.recs[c.Key]
	res := ok && (b.owns(r, c) || b.bug == "complete ignores the fence" && !r.done)
	if ok && !res && r.done && fp != "" && b.bug == "a zombie's complete stores its fingerprint" {
		r.fp = fp
	}
	if res && !r.done {
		r.fp = fp
		r.done = true
		r.until = b.clock.Now().Add(b.ttl)
		if b.bug == "the ttl runs from the claim, not the completion" {
			r.until = r.claimedAt.Add(b.ttl)
		}
	}
	if b.replyLost() || b.bug == unknownWithoutFault && b.rng.IntN(50) == 0 {
		return false, errLost
	}
	return res, nil
}

func (b *broken) Release(ctx context.Context, c store.Claim) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reap()
	if r, ok := b.recs[c.Key]; ok && !r.done && b.owns(r, c) {
		if b.bug == "release deletes the record" {
			delete(b.recs, c.Key)
		} else {
			now := b.clock.Now()
			r.fence++
			r.lease, r.until = now, now.Add(b.ttl)
		}
	}
	if b.replyLost() {
		return errLost
	}
	return nil
}

func (b *broken) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	if err := ctx.Err(); err != nil {
		return c, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reap()
	r, ok := b.recs[c.Key]
	if !ok || r.done || !b.owns(r, c) && b.bug != "extend ignores the fence" ||
		b.bug == "extend answers lost for the current claim" && b.rng.IntN(5) == 0 {
		if b.replyLost() {
			return c, errLost
		}
		return c, fmt.Errorf("broken: %w", store.ErrLost)
	}
	now := b.clock.Now()
	r.lease, r.until = now.Add(lease), now.Add(lease+b.ttl)
	c.LeaseExpiry = r.lease
	if b.replyLost() {
		return c, errLost
	}
	return c, nil
}

func (b *broken) PurgeExpired(ctx context.Context, limit int) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reap()
	now := b.clock.Now()
	n := 0
	for k, r := range b.recs {
		if !now.Before(r.until) || b.bug == "purge deletes records whose lease lapsed" && !r.done && !now.Before(r.lease) {
			delete(b.recs, k)
			n++
		}
	}
	return n, nil
}
