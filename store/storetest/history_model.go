package storetest

// The sequential specification the history check holds a backend to: the
// transition table of package store, one record per key, with time.
//
// Every call carries its window on the backend's clock: Harness.Now read
// just before the call and just after it, widened by a tolerance. The model
// judges each call's guard (lease live? ttl over?) at some instant of that
// window. It does not ask the instants to rise along the order it finds:
// a database stamps a statement with the time it started, and commits it
// later, after statements that started after it. Instants the backend
// reports (the lease expiry of a won claim, the Until of a refusal) are
// taken as they are, after checking that they agree with the window; the
// instants it does not report (when a release or a completion took effect,
// and so when the next lease or ttl ends) are kept as intervals.
//
// The model is nondeterministic: a call that returned an error may or may
// not have taken effect, and a record past its expires-at instant may or may
// not have been deleted. porcupine's power-set construction follows every
// branch.

import (
	"fmt"
	"math"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

type opKind uint8

const (
	opClaim opKind = iota + 1
	opComplete
	opRelease
	opExtend
)

// hInput is one call: what was asked, by whom, and when (backend clock, ns).
type hInput struct {
	kind   opKind
	key    int
	client int
	lease  time.Duration // Claim, Extend
	fence  int64         // Complete, Release, Extend
	token  string        // Complete, Release, Extend: the claim's token
	from   int64         // Harness.Now before the call
	to     int64         // Harness.Now after the call
	zombie bool          // the caller's lease had lapsed on Harness.Now before the call
	fp     string        // Complete: the fingerprint passed to CompleteFingerprint
}

// hOutput is what the call returned.
type hOutput struct {
	unknown bool   // the call failed: it may or may not have taken effect
	err     string // the error, for the report
	pending bool   // still running where a counterexample was cut
	// timedOut marks an unknown outcome whose call ran out of its time
	// (opTimeout): the run's own deadline, not the backend's mistake.
	timedOut bool
	// before marks what a call that retried inside the backend may have
	// done before its answer: a Claim that answered Won may have won once
	// already, lost that reply, and found its lease overtaken when it tried
	// again, or found it and renewed its lease (same fence, same token);
	// an Extend may have extended the claim once before its answer
	// (ErrLost, or a later extension). It took effect, if at all, within the call. (A Claim that
	// answers HeldByOther or AlreadyDone gets no such allowance: the port
	// forbids that answer when the call may have won.)
	before  bool
	outcome store.Outcome
	fence   int64  // Won
	token   string // Won
	expiry  int64  // Won, Extend: the lease expiry reported
	until   int64  // HeldByOther, AlreadyDone: Until, 0 when not reported
	fp      string // Claim: Result.Fingerprint
	ok      bool   // Complete
	lost    bool   // Extend returned ErrLost
}

// rec is the model's view of one key's record. An absent record has only lo.
type rec struct {
	exists bool
	done   bool
	fence  int64
	// token is the token of the claim that last won the record; "?" when
	// that claim's reply was lost, so no caller holds it.
	token string
	// The lease expiry of a Claimed record lies in [leaseLo, leaseHi].
	leaseLo, leaseHi int64
	// The expires-at instant lies in [expLo, expHi].
	expLo, expHi int64
	// fp is the fingerprint a Done record was completed with.
	fp string
}

type model struct {
	ttl  int64 // the backend's ttl
	tol  int64 // tolerance around every window and reported instant
	late int64 // how long after an error a write may still land
	t0   int64 // start of the run, for descriptions
}

func (m *model) porcupine() porcupine.Model {
	nm := porcupine.NondeterministicModel{
		Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
			byKey := map[int][]porcupine.Operation{}
			var keys []int
			for _, op := range h {
				k := op.Input.(hInput).key
				if _, ok := byKey[k]; !ok {
					keys = append(keys, k)
				}
				byKey[k] = append(byKey[k], op)
			}
			out := make([][]porcupine.Operation, 0, len(keys))
			for _, k := range keys {
				out = append(out, byKey[k])
			}
			return out
		},
		Init: func() []any { return []any{rec{}} },
		Step: func(state, input, output any) []any {
			return m.step(state.(rec), input.(hInput), output.(hOutput))
		},
		Hash: func(state any) uint64 {
			s := state.(rec)
			h := uint64(14695981039346656037)
			for _, v := range [...]int64{s.fence, s.leaseLo, s.leaseHi, s.expLo, s.expHi} {
				h = (h ^ uint64(v)) * 1099511628211
			}
			for i := 0; i < len(s.token); i++ {
				h = (h ^ uint64(s.token[i])) * 1099511628211
			}
			for i := 0; i < len(s.fp); i++ {
				h = (h ^ uint64(s.fp[i])) * 1099511628211
			}
			if s.exists {
				h ^= 1
			}
			if s.done {
				h ^= 2
			}
			return h
		},
		DescribeOperation: func(input, output any) string {
			return m.describeOp(input.(hInput), output.(hOutput))
		},
		DescribeState: func(state any) string { return m.describeState(state.(rec)) },
	}
	return nm.ToModel()
}

// step returns every record the call can leave behind, none when the call's
// result is impossible from s.
func (m *model) step(s rec, in hInput, out hOutput) []any {
	var next []any
	if out.unknown {
		next = append(next, s) // it never took effect
	}
	lo := in.from - m.tol
	hi := in.to + m.tol
	if out.unknown && !out.before {
		hi = in.to + m.late
	}
	if lo > hi {
		return next
	}
	for _, r := range m.apply(s, lo, hi, in, out) {
		next = append(next, r)
	}
	// A record past its expires-at instant may have been deleted before the
	// call returned.
	if s.exists && hi >= s.expLo {
		for _, r := range m.apply(rec{}, lo, hi, in, out) {
			next = append(next, r)
		}
	}
	return next
}

// apply takes the call in the window [from, hi] to record r.
//
// Complete, Release and Extend identify a claim by its fence and its token.
// A record deleted after its expires-at instant and created afresh restarts
// at fence 1, so an old claim's fence can match a newer claim's: only the
// token tells them apart, and the port requires a backend to check it. A
// call whose fence matches but whose token does not (a holder from before
// the deletion, or any caller on a record won by a claim whose reply was
// lost) must change nothing; with both, the call must act.
func (m *model) apply(r rec, from, hi int64, in hInput, out hOutput) []rec {
	fenced := r.exists && r.fence == in.fence && r.token == in.token
	mayRefuse := !fenced
	unchanged := func() []rec {
		if !mayRefuse {
			return nil
		}
		return []rec{r}
	}
	switch in.kind {
	case opClaim:
		return m.claim(r, from, hi, in, out)
	case opComplete:
		if out.unknown || out.ok {
			if !fenced {
				return nil
			}
			if r.done {
				return []rec{r}
			}
			return []rec{{exists: true, done: true, fence: r.fence, token: r.token,
				expLo: from + m.ttl, expHi: hi + m.ttl, fp: in.fp}}
		}
		return unchanged() // false
	case opRelease:
		fenced = fenced && !r.done
		mayRefuse = mayRefuse || r.done
		var next []rec
		if fenced {
			next = append(next, m.claimed(r.fence+1, r.token, from, hi))
		}
		if !out.unknown { // the no-op branch covers an unknown outcome
			next = append(next, unchanged()...)
		}
		return next
	case opExtend:
		fenced = fenced && !r.done
		mayRefuse = mayRefuse || r.done
		switch {
		case out.unknown:
			if !fenced {
				return nil
			}
			return []rec{m.claimed(r.fence, r.token, from+int64(in.lease), hi+int64(in.lease))}
		case out.lost:
			return unchanged()
		}
		if !fenced {
			return nil
		}
		at := out.expiry - int64(in.lease)
		a, b := max(from, at-m.tol), min(hi, at+m.tol)
		if a > b {
			return nil
		}
		return []rec{m.claimed(r.fence, r.token, out.expiry, out.expiry)}
	}
	return nil
}

func (m *model) claim(r rec, from, hi int64, in hInput, out hOutput) []rec {
	// Only AlreadyDone reports a fingerprint: the one its record was
	// completed with.
	if !out.unknown && out.fp != "" && out.outcome != store.AlreadyDone {
		return nil
	}
	if out.unknown {
		f, at, ok := m.claimable(r, from, hi)
		if !ok {
			return nil
		}
		token := "?"
		if out.before {
			token = out.token // the same call's token: its retries reuse it
		}
		return []rec{m.claimed(f, token, at+int64(in.lease), hi+int64(in.lease))}
	}
	switch out.outcome {
	case store.Won:
		at := out.expiry - int64(in.lease) // the backend's now when it judged
		a, b := max(from, at-m.tol), min(hi, at+m.tol)
		if r.exists && !r.done && r.token == out.token && r.fence == out.fence && a <= b {
			// A retry of this call found its own claim and renewed it.
			return []rec{m.claimed(r.fence, out.token, out.expiry, out.expiry)}
		}
		f, _, ok := m.claimable(r, a, b)
		if !ok || f != out.fence {
			return nil
		}
		return []rec{m.claimed(f, out.token, out.expiry, out.expiry)}
	case store.HeldByOther:
		if !r.exists || r.done {
			return nil
		}
		if out.until != 0 {
			r.leaseLo, r.leaseHi = max(r.leaseLo, out.until-m.tol), min(r.leaseHi, out.until+m.tol)
			if r.leaseLo > r.leaseHi {
				return nil
			}
			r.expLo, r.expHi = r.leaseLo+m.ttl, r.leaseHi+m.ttl
		}
		if from >= r.leaseHi {
			return nil // every lease it can hold has lapsed by then
		}
		return []rec{r}
	case store.AlreadyDone:
		if !r.exists || !r.done || out.fp != r.fp {
			return nil
		}
		if out.until != 0 {
			r.expLo, r.expHi = max(r.expLo, out.until-m.tol), min(r.expHi, out.until+m.tol)
			if r.expLo > r.expHi {
				return nil
			}
		}
		if from >= r.expHi {
			return nil // the ttl is over by then
		}
		return []rec{r}
	}
	return nil
}

// claimable reports the fence a Claim in the window [a, b] wins r with, and
// the earliest instant it can win, or false when it cannot win in it.
func (m *model) claimable(r rec, a, b int64) (int64, int64, bool) {
	if a > b {
		return 0, 0, false
	}
	switch {
	case !r.exists:
		return 1, a, true
	case r.done:
		if b < r.expLo {
			return 0, 0, false
		}
		return r.fence + 1, max(a, r.expLo), true
	default:
		if b < r.leaseLo {
			return 0, 0, false
		}
		return r.fence + 1, max(a, r.leaseLo), true
	}
}

// claimed is a Claimed record whose lease ends in [leaseLo, leaseHi].
func (m *model) claimed(fence int64, token string, leaseLo, leaseHi int64) rec {
	return rec{exists: true, fence: fence, token: token, leaseLo: leaseLo, leaseHi: leaseHi,
		expLo: leaseLo + m.ttl, expHi: leaseHi + m.ttl}
}

// at renders an instant relative to the start of the run.
func (m *model) at(ns int64) string {
	switch ns {
	case math.MinInt64:
		return "-inf"
	case math.MaxInt64:
		return "+inf"
	}
	return "T" + fmtOffset(time.Duration(ns-m.t0))
}

func fmtOffset(d time.Duration) string {
	if d >= 0 {
		return "+" + d.String()
	}
	return d.String()
}

func (m *model) span(lo, hi int64) string {
	if lo == hi {
		return m.at(lo)
	}
	return "[" + m.at(lo) + ", " + m.at(hi) + "]"
}

func (m *model) describeState(r rec) string {
	switch {
	case !r.exists:
		return "absent"
	case r.done:
		if r.fp != "" {
			return fmt.Sprintf("done fence %d, fingerprint %q, expires %s", r.fence, r.fp, m.span(r.expLo, r.expHi))
		}
		return fmt.Sprintf("done fence %d, expires %s", r.fence, m.span(r.expLo, r.expHi))
	}
	return fmt.Sprintf("claimed fence %d, lease until %s", r.fence, m.span(r.leaseLo, r.leaseHi))
}

func (m *model) describeOp(in hInput, out hOutput) string {
	var call string
	switch in.kind {
	case opClaim:
		call = fmt.Sprintf("Claim(lease %v)", in.lease)
	case opComplete:
		call = fmt.Sprintf("Complete(fence %d)", in.fence)
		if in.fp != "" {
			call = fmt.Sprintf("CompleteFingerprint(fence %d, %q)", in.fence, in.fp)
		}
	case opRelease:
		call = fmt.Sprintf("Release(fence %d)", in.fence)
	case opExtend:
		call = fmt.Sprintf("Extend(fence %d, lease %v)", in.fence, in.lease)
	}
	if in.zombie {
		call = "zombie " + call
	}
	var res string
	switch {
	case out.pending:
		res = "(still running at the cut)"
	case out.before && in.kind == opClaim:
		res = "(a win it may have made before its answer, its reply lost)"
	case out.before:
		res = "(an extension it may have made before its answer, its reply lost)"
	case out.unknown:
		res = "error (outcome unknown): " + out.err
	case in.kind == opClaim:
		res = out.outcome.String()
		if out.outcome == store.Won {
			res += fmt.Sprintf(" fence %d, lease until %s", out.fence, m.at(out.expiry))
		} else if out.until != 0 {
			res += " until " + m.at(out.until)
		}
		if out.fp != "" {
			res += fmt.Sprintf(", fingerprint %q", out.fp)
		}
	case in.kind == opComplete:
		res = fmt.Sprint(out.ok)
	case in.kind == opExtend && out.lost:
		res = "ErrLost"
	case in.kind == opExtend:
		res = "lease until " + m.at(out.expiry)
	default:
		res = "ok"
	}
	return fmt.Sprintf("%s -> %s   during [%s, %s]", call, res, m.at(in.from), m.at(in.to))
}
