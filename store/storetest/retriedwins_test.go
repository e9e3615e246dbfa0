package storetest

import (
	"math"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A Claim that answered an error after retrying for longer than its lease
// may have won twice with its one token: a first attempt's win whose reply
// was lost, then, once that lease lapsed and another caller had claimed and
// released the key, a retry's win whose reply was lost too. The history
// check allows it (retriedWins); with one win per errored call, as before,
// it rejected this history, which TestContract/postgres recorded under
// load: a Claim (lease 800ms) that spanned 6.6 s, held-by-other answers
// until T+9.258s and T+11.520s, and another caller's claim and release of
// the key between them.
func TestHistoryAllowsAnErroredClaimThatOutlastedItsLeaseTwoWins(t *testing.T) {
	const ms = int64(time.Millisecond)
	const late = 400 * time.Millisecond
	m := &model{ttl: int64(2 * time.Second), tol: 2 * ms, late: int64(late)}
	var seq int64
	var ops []porcupine.Operation
	add := func(in hInput, out hOutput) porcupine.Operation {
		seq++
		op := porcupine.Operation{ClientId: in.client, Input: in, Call: seq, Output: out, Return: seq + 1}
		seq++
		if out.unknown {
			op.Return = math.MaxInt64
		}
		ops = append(ops, op)
		return op
	}
	claim := func(client int, lease, from, to int64) hInput {
		return hInput{kind: opClaim, client: client, lease: time.Duration(lease * ms), from: from * ms, to: to * ms}
	}
	// Client 1's Claim runs from 0 to 3 s and fails: it won at 1.0 s
	// (lease until 1.8 s) and again at 2.5 s (until 3.3 s).
	errored := add(claim(1, 800, 0, 3000), hOutput{unknown: true, err: "reply lost"})
	add(claim(2, 400, 900, 1200), hOutput{outcome: store.HeldByOther, until: 1800 * ms})
	won := add(claim(2, 400, 1900, 2100), hOutput{outcome: store.Won, fence: 2, token: "t2", expiry: 2400 * ms})
	ops = append(ops, retriedWins(won, late)...)
	add(hInput{kind: opRelease, client: 2, fence: 2, token: "t2", from: 2100 * ms, to: 2200 * ms}, hOutput{})
	add(claim(3, 400, 2600, 2700), hOutput{outcome: store.HeldByOther, until: 3300 * ms})

	if res := porcupine.CheckOperations(m.porcupine(), ops); res {
		t.Fatal("the history is linearizable with one win for the errored Claim: it shows nothing")
	}
	wins := retriedWins(errored, late)
	if len(wins) != 1 {
		t.Errorf("retriedWins gave a Claim of lease 800ms over 3 s (late %v) %d more wins, want 1", late, len(wins))
	}
	if !porcupine.CheckOperations(m.porcupine(), append(ops, wins...)) {
		t.Fatal("the history of a Claim that won twice before it failed is rejected")
	}
	// A call shorter than its lease cannot win twice: its first win holds
	// the key for the rest of the call.
	short := errored
	short.Input = claim(1, 800, 0, 300)
	if w := retriedWins(short, late); len(w) != 0 {
		t.Errorf("retriedWins gave a Claim of lease 800ms over 300ms (late %v) %d more wins, want none", late, len(w))
	}
}
