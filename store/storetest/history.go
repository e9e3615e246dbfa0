package storetest

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// HistoryOptions sizes a CheckHistory run. The zero value is the run the
// suite makes.
type HistoryOptions struct {
	// Ops is how many calls the clients make in all (Claim, Complete,
	// Release, Extend). Default 10,000.
	Ops int

	// Keys is how many keys are in play at once. Each group of clients
	// works on one key at a time, and moves on to a fresh key (the next
	// message) now and then once the key is done, coming back to old keys
	// as redeliveries do. Each key is checked as its own history.
	// Default 50.
	Keys int

	// ClientsPerKey is how many concurrent clients work on each key in
	// play. Default 3.
	ClientsPerKey int

	// Seed seeds the clients' choices. Zero picks a seed at random; the run
	// logs the seed it used.
	Seed uint64

	// FaultRate is the share of calls before which the run asks
	// Harness.Faults to lose the next reply; one call in ten times as many
	// is preceded by a cut of every connection. Default 0.015; negative
	// turns faults off. Ignored when the Harness has no Faults.
	FaultRate float64

	// PurgeEvery makes the run call PurgeExpired once every so many calls,
	// from a goroutine of its own, when the backend is a [store.Purger].
	// Default 200; negative never purges.
	PurgeEvery int

	// Tolerance is how far an instant the backend reports or judges by may
	// stray outside a call's window on Harness.Now: backends that keep
	// milliseconds need a little. Default 2ms.
	Tolerance time.Duration

	// LateWrite is how long after a call returned an error its write may
	// still take effect (a request already on its way to the server when
	// its connection was cut). Default two Steps.
	LateWrite time.Duration

	// MinRestarts, when positive, fails the run unless at least that many
	// claims won fence 1 on a key that had had a higher fence: a record
	// deleted after its expires-at and claimed afresh. A backend whose
	// storage deletes expired records by itself (Redis) sets it to show
	// that the run met deletions, and so checked that a claim from before
	// a deletion, with the same fence and another token, changes nothing.
	MinRestarts int
}

// opTimeout bounds one call of the run in real time.
const opTimeout = 10 * time.Second

// CheckHistory runs concurrent clients against h.Backend and checks that the
// history they record is linearizable with respect to the transition table
// of package store, time included.
//
// Each key has a few clients that behave like the verbs built on the port:
// they claim with short leases; when they win they complete, release,
// extend (when the backend is a [store.Extender]), keep working until the
// lease lapses, or crash and come back later as zombies that complete or
// release (or extend) an old claim; once a key is done they mostly move on
// to a fresh key, and come back to old ones as redeliveries do. Leases lapse
// and ttls end during the run: with h.Advance, a goroutine moves the clock
// forward in small steps while calls are in flight, in pace with the calls;
// without it, calls are paced so that the run lasts about two and a half
// ttls of real time (so a real-clock harness should keep its TTL at a
// second or two). With h.Faults, replies are lost and connections cut at
// random; a call that returns an error is recorded with an unknown outcome.
// Without faults (no h.Faults, or a negative FaultRate) no call may return
// an error, unless it ran out of the 10 seconds the run gives one call:
// with every reply delivered, an answer of unknown outcome is the
// backend's mistake (an abort or a refusal taken for a lost reply).
// When the backend is a [store.Purger], PurgeExpired runs now and then.
// When it is a [store.Fingerprinter], every Complete is a
// CompleteFingerprint with a fingerprint of the claim's own (none for about
// one claim in four), and every AlreadyDone must report the fingerprint of
// the completion that made the record done, every other outcome none.
//
// Every call is recorded with its window on the backend's clock (h.Now
// before and after it). The checker (github.com/anishathalye/porcupine)
// looks for an order of the calls, consistent with real time, in which each
// call's result follows from the transition table at some instant of its
// window: a won claim's lease expiry must be its lease past that instant,
// Until must be the holder's lease expiry or the end of the ttl, the fence
// must rise by one on every reclaim and release and start at 1 only on a
// record that was absent or past its expires-at instant. When there is
// none, the run fails with the shortest failing prefix of the offending
// key's history and writes porcupine's visualization of it to a file that
// the message names.
//
// What a correct backend may do and the check allows: stamp a call with any
// instant of its window, not necessarily in the order in which it
// serializes the calls (a database's statement time); and, when it
// retries inside a call, win or extend once before the answer it gives
// (Won, an Extend's answer, or an error when the call outlasted its
// lease: a retry after its earlier win lapsed and the record moved on wins
// afresh with the call's token), or find its own claim and renew its lease.
// It never allows a Claim to answer HeldByOther or AlreadyDone when the
// call may have won, nor a Complete, Release or Extend to act on a record
// whose fence matches but whose claim token does not: after a record is
// deleted past its expires-at (by PurgeExpired, or by the storage itself,
// as Redis does) the next Claim starts again at fence 1, and a holder from
// before the deletion carries that fence with another token.
//
// h must be valid for Run. When h.Faults is set, the backend and its fault
// path must not be shared with other tests running at the same time.
func CheckHistory(t *testing.T, h Harness, opts HistoryOptions) {
	t.Helper()
	checkHistory(t, newEnv(t, h).h, opts)
}

// historyT is the part of *testing.T a history run uses; the checker's own
// tests record what it reports through it.
type historyT interface {
	Helper()
	Context() context.Context
	Logf(format string, args ...any)
	Errorf(format string, args ...any)
	Error(args ...any)
}

// historyCase is the suite's rule.
func historyCase(t *testing.T, e *env) { checkHistory(t, e.h, HistoryOptions{Ops: e.h.HistoryOps}) }

type historyRun struct {
	t      historyT
	h      Harness
	o      HistoryOptions
	ctx    context.Context
	base   string
	gens   []atomic.Int64 // per key in play: the generation of its current key
	x      store.Extender
	f      store.Fingerprinter
	leases []time.Duration
	// Real time: call i starts no earlier than start + i*gap.
	start time.Time
	gap   time.Duration
	// With Advance: the clock has been moved on for this many calls, and
	// a call waits while more than lag calls are not yet paid for.
	applied atomic.Int64
	lag     int64
	stop    chan struct{}

	left  atomic.Int64 // calls still to make
	calls atomic.Int64 // calls made
	busy  atomic.Int64 // calls in flight
	seq   atomic.Int64 // porcupine's order of call and return events

	lostReplies, cuts, purges, purged, purgeErrs atomic.Int64
}

type clientLog struct {
	ops []porcupine.Operation
}

// checkHistory runs and checks one history on a Harness that newEnv has
// completed, and returns what the run exercised.
func checkHistory(t historyT, h Harness, o HistoryOptions) historyStats {
	t.Helper()
	if o.Ops <= 0 {
		o.Ops = 10000
	}
	if o.Keys <= 0 {
		o.Keys = 50
	}
	if o.ClientsPerKey <= 0 {
		o.ClientsPerKey = 3
	}
	if o.Seed == 0 {
		o.Seed = rand.Uint64()
	}
	if o.FaultRate == 0 {
		o.FaultRate = 0.015
	}
	if o.PurgeEvery == 0 {
		o.PurgeEvery = 200
	}
	if o.Tolerance <= 0 {
		o.Tolerance = 2 * time.Millisecond
	}
	if o.LateWrite <= 0 {
		o.LateWrite = 2 * h.Step
	}
	r := &historyRun{t: t, h: h, o: o, ctx: t.Context()}
	r.x, _ = h.Backend.(store.Extender)
	r.f, _ = h.Backend.(store.Fingerprinter)
	r.leases = []time.Duration{h.Step, 2 * h.Step, 4 * h.Step}
	r.base = fmt.Sprintf("storetest/history/%016x", rand.Uint64())
	r.gens = make([]atomic.Int64, o.Keys)
	r.left.Store(int64(o.Ops))
	t.Logf("history: %d calls by %d clients on %d keys at a time, seed %d, step %v, ttl %v, advance %v, faults %v",
		o.Ops, o.Keys*o.ClientsPerKey, o.Keys, o.Seed, h.Step, h.TTL, h.Advance != nil, h.Faults != nil && o.FaultRate > 0)

	faulty := h.Faults != nil && o.FaultRate > 0
	t0 := h.Now()
	opsPerKey := float64(o.Ops) / float64(o.Keys)
	// Aim for a run a few ttls long, with a key seeing a call about every
	// half Step or more.
	span := 2.5 * float64(h.TTL)
	r.stop = make(chan struct{})
	var bg sync.WaitGroup
	if h.Advance != nil {
		perKey := max(float64(h.Step)/2, span/opsPerKey)
		r.lag = int64(max(1, o.Keys/2))
		bg.Go(func() { r.advance(time.Duration(perKey/float64(o.Keys)), time.Duration(perKey)) })
	} else {
		r.gap = time.Duration(span / float64(o.Ops))
	}
	if p, ok := h.Backend.(store.Purger); ok && o.PurgeEvery > 0 {
		bg.Go(func() { r.purge(p) })
	}

	logs := make([]*clientLog, o.Keys*o.ClientsPerKey)
	var wg sync.WaitGroup
	start := time.Now()
	r.start = start
	for k := range o.Keys {
		for j := range o.ClientsPerKey {
			id := k*o.ClientsPerKey + j
			logs[id] = &clientLog{}
			rng := rand.New(rand.NewPCG(o.Seed, uint64(id)))
			wg.Go(func() { r.client(id, k, rng, logs[id]) })
		}
	}
	wg.Wait()
	close(r.stop)
	bg.Wait()
	runTime := time.Since(start)

	var ops []porcupine.Operation
	for _, l := range logs {
		ops = append(ops, l.ops...)
	}
	m := &model{ttl: int64(h.TTL), tol: int64(o.Tolerance), late: int64(o.LateWrite), t0: t0.UnixNano()}
	st := summarize(ops)
	st.run = runTime
	startCheck := time.Now()
	res := porcupine.CheckOperationsTimeout(m.porcupine(), ops, 5*time.Minute)
	checkTime := time.Since(startCheck)
	st.check, st.result = checkTime, res
	t.Logf("history: %d calls in %v, checked in %v: %s; %s; %d lost replies, %d cuts, %d purges removed %d records (%d failed)",
		st.calls, runTime.Round(time.Millisecond), checkTime.Round(time.Millisecond), res, st,
		r.lostReplies.Load(), r.cuts.Load(), r.purges.Load(), r.purged.Load(), r.purgeErrs.Load())
	switch res {
	case porcupine.Ok:
	case porcupine.Unknown:
		t.Errorf("history: the checker gave up after 5 minutes on %d calls; lower HistoryOptions.Ops or ClientsPerKey", st.calls)
		return st
	default:
		t.Error(m.counterexample(ops))
		return st
	}
	if !faulty {
		// No fault was injected: every call had its reply, so an answer
		// of unknown outcome is a backend's mistake (it took a refusal
		// or an abort for a lost reply), unless the call ran out of the
		// run's time for one call.
		var bad []string
		for _, op := range ops {
			in, out := op.Input.(hInput), op.Output.(hOutput)
			if out.unknown && !out.before && !out.timedOut {
				bad = append(bad, fmt.Sprintf("client %d: %s", op.ClientId, m.describeOp(in, out)))
			}
		}
		if len(bad) > 0 {
			t.Errorf("history: UNKNOWN OUTCOME WITHOUT A FAULT: %d calls returned an error although no fault was injected "+
				"and none ran out of its %v (a backend answers unknown only when a reply was lost); the first: %s",
				len(bad), opTimeout, strings.Join(bad[:min(len(bad), 5)], "; "))
		}
	}
	if st.restarts < o.MinRestarts {
		t.Errorf("history: %d fences restarted at 1, want at least %d: too few records were deleted after their expires-at during the run",
			st.restarts, o.MinRestarts)
	}
	if o.Ops >= 5000 && (st.lapses == 0 || st.ttlEnds == 0) {
		t.Errorf("history: no lease lapsed (%d) or no ttl ended (%d) during the run, so it proved little: "+
			"a real-time Harness should keep TTL near a second", st.lapses, st.ttlEnds)
	}
	return st
}

// advance moves the backend's clock on by perCall for every call made, in
// steps of at most a quarter Step, while calls are in flight. When no call
// is in flight for a millisecond (every client is waiting for time to
// pass), it moves the clock on by idle.
func (r *historyRun) advance(perCall, idle time.Duration) {
	var applied int64
	quiet := time.Now()
	for {
		select {
		case <-r.stop:
			return
		default:
		}
		n := r.calls.Load()
		var d time.Duration
		switch {
		case n > applied:
			d = time.Duration(n-applied) * perCall
			quiet = time.Now()
		case r.busy.Load() > 0:
			quiet = time.Now()
			time.Sleep(20 * time.Microsecond)
			continue
		case time.Since(quiet) > time.Millisecond:
			d = idle
			quiet = time.Now()
		default:
			time.Sleep(20 * time.Microsecond)
			continue
		}
		for d > 0 {
			s := min(d, r.h.Step/4)
			r.h.Advance(s)
			d -= s
		}
		applied = n
		r.applied.Store(n)
	}
}

// pace holds call number i back: in real time until its turn, with Advance
// until the clock has caught up with the calls before it.
func (r *historyRun) pace(i int64) {
	if r.h.Advance == nil {
		time.Sleep(time.Until(r.start.Add(time.Duration(i) * r.gap)))
		return
	}
	for r.calls.Load()-r.applied.Load() > r.lag {
		select {
		case <-r.stop:
			return
		default:
			time.Sleep(20 * time.Microsecond)
		}
	}
}

// wait lets d go by on the backend's clock.
func (r *historyRun) wait(d time.Duration) {
	if r.h.Advance == nil {
		time.Sleep(d)
		return
	}
	until := r.h.Now().Add(d)
	for r.h.Now().Before(until) && r.ctx.Err() == nil {
		time.Sleep(50 * time.Microsecond)
	}
}

func (r *historyRun) purge(p store.Purger) {
	next := int64(r.o.PurgeEvery)
	for {
		select {
		case <-r.stop:
			return
		default:
		}
		if r.calls.Load() < next {
			time.Sleep(time.Millisecond)
			continue
		}
		next += int64(r.o.PurgeEvery)
		ctx, cancel := context.WithTimeout(r.ctx, opTimeout)
		n, err := p.PurgeExpired(ctx, 0)
		cancel()
		r.purges.Add(1)
		r.purged.Add(int64(n))
		if err != nil {
			r.purgeErrs.Add(1)
		}
	}
}

// keyID names generation gen of the key in play slot.
func keyID(slot int, gen int64) int { return slot<<24 | int(gen) }

func (r *historyRun) keyName(id int) string {
	return fmt.Sprintf("%s/%d/%d", r.base, id>>24, id&(1<<24-1))
}

// client plays one caller of the verbs on the keys of slot until the run's
// calls are used up.
func (r *historyRun) client(id, slot int, rng *rand.Rand, log *clientLog) {
	var held *store.Claim
	var heldKey int
	type old struct {
		c   store.Claim
		key int
	}
	var zombies []old
	retire := func(c store.Claim, key int) {
		zombies = append(zombies, old{c, key})
		if len(zombies) > 4 {
			zombies = zombies[1:]
		}
	}
	// next moves the clients of slot on from gen to a fresh key.
	next := func(gen int64) { r.gens[slot].CompareAndSwap(gen, gen+1) }
	lease := func() time.Duration { return r.leases[rng.IntN(len(r.leases))] }
	for r.left.Load() > 0 && r.ctx.Err() == nil {
		p := rng.Float64()
		switch {
		case held != nil && p < 0.40:
			ok, unknown := r.complete(id, heldKey, *held, false, log)
			if unknown && rng.IntN(2) == 0 {
				continue // retry it
			}
			if !ok || rng.IntN(4) == 0 {
				retire(*held, heldKey)
			}
			if ok && rng.IntN(2) == 0 {
				next(int64(heldKey & (1<<24 - 1)))
			}
			held = nil
		case held != nil && p < 0.60:
			if r.release(id, heldKey, *held, false, log) && rng.IntN(2) == 0 {
				continue
			}
			if rng.IntN(2) == 0 {
				retire(*held, heldKey) // a released claim must never complete
			}
			held = nil
		case held != nil && p < 0.70 && r.x != nil:
			c, lost := r.extend(id, heldKey, *held, lease(), false, log)
			if lost {
				retire(*held, heldKey)
				held = nil
			} else {
				held = &c
			}
		case held != nil && p < 0.82:
			// The holder crashes; it may come back later as a zombie.
			retire(*held, heldKey)
			held = nil
		case held != nil:
			// Still working: the lease may lapse meanwhile.
			r.wait(rand.N(max(held.LeaseExpiry.Sub(r.h.Now()), 0) + r.h.Step))
		case len(zombies) > 0 && p < 0.15:
			z := zombies[rng.IntN(len(zombies))]
			switch q := rng.IntN(5); {
			case q < 2:
				r.complete(id, z.key, z.c, true, log)
			case q < 4 || r.x == nil:
				r.release(id, z.key, z.c, true, log)
			default:
				// A heartbeat that outlived its holder's claim.
				r.extend(id, z.key, z.c, lease(), true, log)
			}
		default:
			gen := r.gens[slot].Load()
			if gen > 0 && p < 0.30 {
				gen = rng.Int64N(gen) // a redelivery of an older message
			}
			key := keyID(slot, gen)
			res, ok := r.claim(id, key, lease(), log)
			switch {
			case !ok:
			case res.Outcome == store.Won:
				held, heldKey = &res.Claim, key
			case res.Outcome == store.AlreadyDone && rng.IntN(2) == 0:
				next(gen)
			case res.Outcome == store.AlreadyDone:
				r.wait(rand.N(r.h.TTL / 4))
			case res.Outcome == store.HeldByOther && rng.IntN(2) == 0:
				r.wait(rand.N(2 * r.h.Step))
			}
		}
	}
}

// call makes one recorded call; it returns false when the run's calls are
// used up, without calling.
func (r *historyRun) call(in hInput, log *clientLog, f func(ctx context.Context) hOutput) (hOutput, bool) {
	n := r.left.Add(-1)
	if n < 0 {
		return hOutput{}, false
	}
	r.pace(int64(r.o.Ops) - n - 1)
	if r.h.Faults != nil && r.o.FaultRate > 0 {
		if rand.Float64() < r.o.FaultRate {
			r.h.Faults.LoseNextReply()
			r.lostReplies.Add(1)
		}
		if rand.Float64() < r.o.FaultRate/10 {
			r.h.Faults.CutConnections()
			r.cuts.Add(1)
		}
	}
	ctx, cancel := context.WithTimeout(r.ctx, opTimeout)
	r.busy.Add(1)
	defer r.busy.Add(-1)
	in.from = r.h.Now().UnixNano()
	call := r.seq.Add(1)
	out := f(ctx)
	ret := r.seq.Add(1)
	in.to = r.h.Now().UnixNano()
	out.timedOut = out.unknown && ctx.Err() != nil
	cancel()
	r.calls.Add(1)
	op := porcupine.Operation{ClientId: in.client, Input: in, Call: call, Output: out, Return: ret}
	if out.unknown {
		// It may take effect at any point after its call.
		op.Return = math.MaxInt64
	}
	log.ops = append(log.ops, op)
	return out, true
}

func failed(err error) hOutput { return hOutput{unknown: true, err: err.Error()} }

func (r *historyRun) lapsed(c store.Claim) bool { return !r.h.Now().Before(c.LeaseExpiry) }

func (r *historyRun) claim(id, k int, lease time.Duration, log *clientLog) (store.Result, bool) {
	var won store.Claim
	key := r.keyName(k)
	out, ok := r.call(hInput{kind: opClaim, key: k, client: id, lease: lease}, log, func(ctx context.Context) hOutput {
		res, err := r.h.Backend.Claim(ctx, key, lease)
		if err != nil {
			return failed(err)
		}
		out := hOutput{outcome: res.Outcome, until: unixNano(res.Until), fp: res.Fingerprint}
		if res.Outcome == store.Won {
			won = res.Claim
			out.fence, out.token, out.expiry = res.Claim.Fence, res.Claim.Token, unixNano(res.Claim.LeaseExpiry)
		}
		return out
	})
	if !ok {
		return store.Result{}, false
	}
	if out.unknown || out.outcome == store.Won {
		log.ops = append(log.ops, retriedWins(log.ops[len(log.ops)-1], r.o.LateWrite)...)
	}
	if out.unknown {
		return store.Result{}, false
	}
	if out.outcome == store.Won && won.Key != key {
		r.t.Errorf("history: Claim(%q) won a claim on key %q", key, won.Key)
	}
	return store.Result{Outcome: out.outcome, Claim: won}, true
}

// retriedWins returns what the Claim call op (which answered Won, or an
// error) may also have won before its answer. A backend that retries inside
// a call (after a lost reply or a cut connection) reuses the call's token:
// a retry that finds its own claim renews it, but one that comes after that
// claim's lease lapsed and the record moved on wins afresh, and its reply
// may be lost too. So a call that answered Won may have won once before,
// and one that answered an error, whose own attempt may have won, may have
// won once before that when its window (stretched by late: its last
// attempt's write may land that late) is longer than its lease. On an idle
// machine a call's retries are quick and it wins once; on a loaded one a
// Claim of PostgreSQL's sqllock spanned 6.6 s (lease 800ms) and won at two
// instants 2.3 s apart, both replies lost, then answered an error. More
// wins per call are not allowed: each one more such op per call multiplies
// the checker's search (one per lease of the window made it give up after
// 5 minutes on a loaded machine's history).
func retriedWins(op porcupine.Operation, late time.Duration) []porcupine.Operation {
	in, out := op.Input.(hInput), op.Output.(hOutput)
	if out.unknown && in.to+int64(late)-in.from <= int64(in.lease) {
		return nil
	}
	op.Output = hOutput{unknown: true, before: true, token: out.token}
	return []porcupine.Operation{op}
}

// fingerprintOf is the payload fingerprint a client completes claim c with
// on a store.Fingerprinter: one of its own, so that a fingerprint stored by
// the wrong claim shows, and none for about one claim in four, so that
// plain completions mix with the others on every key. A retry of the same
// claim's complete carries the same one, as the verbs' retries do.
func fingerprintOf(c store.Claim) string {
	h := fnv.New32a()
	h.Write([]byte(c.Token))
	if h.Sum32()%4 == 0 {
		return ""
	}
	return "fp/" + c.Token
}

// complete returns the result and whether it is unknown. On a
// store.Fingerprinter it calls CompleteFingerprint.
func (r *historyRun) complete(id, k int, c store.Claim, zombie bool, log *clientLog) (bool, bool) {
	in := hInput{kind: opComplete, key: k, client: id, fence: c.Fence, token: c.Token, zombie: zombie && r.lapsed(c)}
	if r.f != nil {
		in.fp = fingerprintOf(c)
	}
	out, ok := r.call(in, log, func(ctx context.Context) hOutput {
		var done bool
		var err error
		if r.f != nil {
			done, err = r.f.CompleteFingerprint(ctx, c, in.fp)
		} else {
			done, err = r.h.Backend.Complete(ctx, c)
		}
		if err != nil {
			return failed(err)
		}
		return hOutput{ok: done}
	})
	return ok && out.ok, ok && out.unknown
}

// release reports whether its outcome is unknown.
func (r *historyRun) release(id, k int, c store.Claim, zombie bool, log *clientLog) bool {
	in := hInput{kind: opRelease, key: k, client: id, fence: c.Fence, token: c.Token, zombie: zombie && r.lapsed(c)}
	out, ok := r.call(in, log, func(ctx context.Context) hOutput {
		if err := r.h.Backend.Release(ctx, c); err != nil {
			return failed(err)
		}
		return hOutput{}
	})
	return ok && out.unknown
}

// extend returns the renewed claim, or reports it lost.
func (r *historyRun) extend(id, k int, c store.Claim, lease time.Duration, zombie bool, log *clientLog) (store.Claim, bool) {
	next := c
	in := hInput{kind: opExtend, key: k, client: id, fence: c.Fence, token: c.Token, lease: lease, zombie: zombie && r.lapsed(c)}
	out, ok := r.call(in, log, func(ctx context.Context) hOutput {
		ext, err := r.x.Extend(ctx, c, lease)
		switch {
		case errors.Is(err, store.ErrLost):
			return hOutput{lost: true}
		case err != nil:
			return failed(err)
		}
		next = ext
		return hOutput{expiry: unixNano(ext.LeaseExpiry)}
	})
	if ok && !out.unknown {
		// The backend may have extended the claim and lost the reply, and
		// then extended it again or found it taken over when it tried
		// again: the answer holds at the end of the call, and an extension
		// may precede it.
		op := log.ops[len(log.ops)-1]
		op.Output = hOutput{unknown: true, before: true}
		log.ops = append(log.ops, op)
	}
	if ok && !out.unknown && !out.lost && next.Fence != c.Fence {
		r.t.Errorf("history: Extend changed the fence from %d to %d", c.Fence, next.Fence)
	}
	return next, ok && out.lost
}

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

// historyStats counts what a run exercised.
type historyStats struct {
	calls, unknown               int
	won, held, done              int
	doneWithFP                   int // already done reporting a fingerprint
	completed, refused, releases int
	extended, lostExt, zombies   int
	lapses, ttlEnds, restarts    int
	run, check                   time.Duration
	result                       porcupine.CheckResult
}

func (s historyStats) String() string {
	return fmt.Sprintf("claims won %d, held by other %d, already done %d (%d with a fingerprint); completes true %d, false %d; releases %d; "+
		"extends %d, lost %d; zombie calls %d; unknown outcomes %d; reclaims after a lapsed lease %d, after the ttl %d; fences restarted at 1 %d",
		s.won, s.held, s.done, s.doneWithFP, s.completed, s.refused, s.releases, s.extended, s.lostExt, s.zombies, s.unknown,
		s.lapses, s.ttlEnds, s.restarts)
}

// summarize counts outcomes, and the lapses that the clients witnessed: a
// claim won after a claim that nobody released or completed (its lease
// lapsed), or after a successful completion (its ttl ended).
func summarize(ops []porcupine.Operation) historyStats {
	var s historyStats
	type event struct {
		at  int64
		ret bool
		op  *porcupine.Operation
	}
	byKey := map[int][]event{}
	for i := range ops {
		op := &ops[i]
		in, out := op.Input.(hInput), op.Output.(hOutput)
		if out.before {
			continue // the other half of a call counted already
		}
		s.calls++
		if in.zombie {
			s.zombies++
		}
		if out.unknown {
			s.unknown++
			continue
		}
		switch in.kind {
		case opClaim:
			switch out.outcome {
			case store.Won:
				s.won++
			case store.HeldByOther:
				s.held++
			case store.AlreadyDone:
				s.done++
				if out.fp != "" {
					s.doneWithFP++
				}
			}
		case opComplete:
			if out.ok {
				s.completed++
			} else {
				s.refused++
			}
		case opRelease:
			s.releases++
		case opExtend:
			if out.lost {
				s.lostExt++
			} else {
				s.extended++
			}
		}
		byKey[in.key] = append(byKey[in.key], event{op.Call, false, op}, event{op.Return, true, op})
	}
	for _, evs := range byKey {
		sort.Slice(evs, func(i, j int) bool { return evs[i].at < evs[j].at })
		live := map[int64]bool{} // won claims neither released nor completed
		doneSeen, maxFence := false, int64(0)
		for _, ev := range evs {
			in, out := ev.op.Input.(hInput), ev.op.Output.(hOutput)
			switch {
			case in.kind == opClaim && out.outcome == store.Won && !ev.ret:
				if doneSeen {
					s.ttlEnds++
				} else if len(live) > 0 {
					s.lapses++
				}
				if out.fence == 1 && maxFence > 0 {
					s.restarts++
				}
				doneSeen = false
				clear(live)
			case in.kind == opClaim && out.outcome == store.Won:
				live[out.fence] = true
				maxFence = max(maxFence, out.fence)
			case in.kind == opRelease && ev.ret:
				delete(live, in.fence)
			case in.kind == opComplete && ev.ret && out.ok:
				delete(live, in.fence)
				doneSeen = true
			}
		}
	}
	return s
}

// counterexample finds a key whose history is not linearizable, cuts it to
// its shortest non-linearizable prefix, and describes that prefix.
func (m *model) counterexample(ops []porcupine.Operation) string {
	pm := m.porcupine()
	parts := pm.Partition(ops)
	single := pm
	single.Partition = nil
	var bad []porcupine.Operation
	for _, p := range parts {
		if porcupine.CheckOperationsTimeout(single, p, time.Minute) == porcupine.Illegal {
			bad = p
			break
		}
	}
	if bad == nil {
		return "history: not linearizable, but no single key's history could be shown to fail within a minute"
	}
	key := bad[0].Input.(hInput).key

	// The history up to instant R: calls returned by R as they are, calls
	// still running at R with an unknown outcome. If the whole history is
	// linearizable so is every such prefix, so the shortest failing one
	// is a counterexample on its own, and the call that returned at R is
	// the one no order can explain.
	var rets []int64
	for _, op := range bad {
		if op.Return != math.MaxInt64 {
			rets = append(rets, op.Return)
		}
	}
	slices.Sort(rets)
	cut := func(R int64) []porcupine.Operation {
		var out []porcupine.Operation
		for _, op := range bad {
			if op.Call > R {
				continue
			}
			if op.Return > R && op.Return != math.MaxInt64 {
				o := op.Output.(hOutput)
				o.unknown, o.pending = true, true
				op.Output, op.Return = o, math.MaxInt64
			}
			out = append(out, op)
		}
		return out
	}
	i := sort.Search(len(rets), func(i int) bool {
		return porcupine.CheckOperationsTimeout(single, cut(rets[i]), time.Minute) == porcupine.Illegal
	})
	prefix := bad
	var culprit *porcupine.Operation
	if i < len(rets) {
		prefix = cut(rets[i])
		for _, op := range prefix {
			if op.Return == rets[i] && !op.Output.(hOutput).before {
				culprit = &op
			}
		}
	}
	sort.SliceStable(prefix, func(a, b int) bool { return prefix[a].Call < prefix[b].Call })

	var b strings.Builder
	fmt.Fprintf(&b, "history: NOT LINEARIZABLE on key %d/%d: no order of its calls, each taking effect at one instant of its window, "+
		"follows the transition table of package store (T = the run's start on the backend's clock).\n", key>>24, key&(1<<24-1))
	if culprit != nil {
		fmt.Fprintf(&b, "The history up to the return of this call already fails:\n    client %d: %s\n",
			culprit.ClientId, m.describeOp(culprit.Input.(hInput), culprit.Output.(hOutput)))
	}
	const show = 40
	shown := prefix
	if len(shown) > show {
		fmt.Fprintf(&b, "Its last %d calls (of %d; the earlier ones are in the visualization), in the order they were made:\n", show, len(prefix))
		shown = shown[len(shown)-show:]
	} else {
		fmt.Fprintf(&b, "Its %d calls, in the order they were made:\n", len(prefix))
	}
	for _, op := range shown {
		mark := "  "
		if culprit != nil && op.Call == culprit.Call && !op.Output.(hOutput).before {
			mark = "=>"
		}
		fmt.Fprintf(&b, "  %s client %d: %s\n", mark, op.ClientId, m.describeOp(op.Input.(hInput), op.Output.(hOutput)))
	}
	_, info := porcupine.CheckOperationsVerbose(single, prefix, time.Minute)
	if f, err := os.CreateTemp("", "storetest-history-*.html"); err != nil {
		fmt.Fprintf(&b, "(no visualization: %v)\n", err)
	} else {
		err := porcupine.Visualize(single, info, f)
		f.Close()
		if err != nil {
			fmt.Fprintf(&b, "(no visualization: %v)\n", err)
		} else {
			fmt.Fprintf(&b, "porcupine's visualization of this prefix, with its longest linearizations: %s\n", f.Name())
		}
	}
	return b.String()
}
