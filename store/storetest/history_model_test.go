package storetest

import (
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The model's step, call by call: the answers that would lose a delivery
// or run a body twice have no successor state (the checker rejects the
// history), the answers a correct backend may give have one, and an error
// leaves both "it took effect" and "it did not" open.
func TestHistoryModelStep(t *testing.T) {
	const (
		s     = int64(time.Second)
		ttl   = 3600 * s
		t0    = 1000 * s
		lease = 10 * s
	)
	m := &model{ttl: ttl, tol: int64(time.Millisecond), late: 5 * s, t0: t0}
	absent := rec{}
	held := m.claimed(3, "tok", t0+lease, t0+lease) // claimed, fence 3, lease ends at t0+10s
	done := rec{exists: true, done: true, fence: 3, token: "tok", expLo: t0 + ttl, expHi: t0 + ttl}
	call := func(kind opKind, at int64, fence int64, token string) hInput {
		return hInput{kind: kind, key: 1, client: 1, lease: time.Duration(lease), fence: fence, token: token, from: at, to: at + s/100}
	}
	won := func(fence int64, at int64) hOutput {
		return hOutput{outcome: store.Won, fence: fence, token: "new", expiry: at + lease}
	}
	for _, tc := range []struct {
		name string
		from rec
		in   hInput
		out  hOutput
		want []string // the successor states, described; none: rejected
	}{
		{"a claim on an absent key wins fence 1", absent, call(opClaim, t0, 0, ""), won(1, t0),
			[]string{"claimed fence 1"}},
		{"a claim on an absent key cannot win fence 2", absent, call(opClaim, t0, 0, ""), won(2, t0), nil},
		{"a claim on an absent key cannot be held by other", absent, call(opClaim, t0, 0, ""),
			hOutput{outcome: store.HeldByOther}, nil},
		{"a claim on an absent key cannot be already done", absent, call(opClaim, t0, 0, ""),
			hOutput{outcome: store.AlreadyDone}, nil},
		{"a claim during a live lease is held by other", held, call(opClaim, t0+s, 0, ""),
			hOutput{outcome: store.HeldByOther, until: t0 + lease}, []string{"claimed fence 3"}},
		{"a claim during a live lease cannot win (two winners)", held, call(opClaim, t0+s, 0, ""), won(4, t0+s), nil},
		{"a claim after the lease lapsed cannot be held by other", held, call(opClaim, t0+lease+s, 0, ""),
			hOutput{outcome: store.HeldByOther}, nil},
		{"a claim after the lease lapsed wins the next fence", held, call(opClaim, t0+lease+s, 0, ""), won(4, t0+lease+s),
			[]string{"claimed fence 4"}},
		{"a claim within the ttl is already done", done, call(opClaim, t0+s, 0, ""),
			hOutput{outcome: store.AlreadyDone}, []string{"done fence 3"}},
		{"a claim within the ttl cannot win (a second run)", done, call(opClaim, t0+s, 0, ""), won(4, t0+s), nil},
		{"a claim after the ttl cannot be already done", done, call(opClaim, t0+ttl+s, 0, ""),
			hOutput{outcome: store.AlreadyDone}, nil},
		{"a claim that failed may or may not have won", absent, call(opClaim, t0, 0, ""),
			hOutput{unknown: true}, []string{"absent", "claimed fence 1"}},
		{"complete with the current fence marks done", held, call(opComplete, t0+s, 3, "tok"), hOutput{ok: true},
			[]string{"done fence 3"}},
		{"complete with a stale fence cannot answer true", held, call(opComplete, t0+s, 2, "old"), hOutput{ok: true}, nil},
		{"complete with the current fence and token cannot answer false", held, call(opComplete, t0+s, 3, "tok"), hOutput{}, nil},
		{"complete with a stale fence answers false and changes nothing", held, call(opComplete, t0+s, 2, "old"), hOutput{},
			[]string{"claimed fence 3"}},
		{"a fence from before a deletion may be refused by its token", held, call(opComplete, t0+s, 3, "old"), hOutput{},
			[]string{"claimed fence 3"}},
		{"a fence from before a deletion cannot complete the new record", held, call(opComplete, t0+s, 3, "old"), hOutput{ok: true}, nil},
		{"a fence from before a deletion cannot complete a new done record", done, call(opComplete, t0+s, 3, "old"), hOutput{ok: true}, nil},
		{"a fence from before a deletion cannot extend the new record", held, call(opExtend, t0+s, 3, "old"), hOutput{expiry: t0 + s + lease}, nil},
		{"a fence from before a deletion leaves the new record's lease alone", held, call(opRelease, t0+s, 3, "old"), hOutput{},
			[]string{"claimed fence 3, lease until T+10s"}},
		{"release of the current claim raises the fence, and only that", held, call(opRelease, t0+s, 3, "tok"), hOutput{},
			[]string{"claimed fence 4, lease until [T+999ms"}},
		{"a released key is claimable at once", m.claimed(4, "tok", t0+s, t0+s), call(opClaim, t0+2*s, 0, ""), won(5, t0+2*s),
			[]string{"claimed fence 5"}},
		{"extend of the current claim cannot be lost", held, call(opExtend, t0+s, 3, "tok"), hOutput{lost: true}, nil},
		{"extend of a done claim is lost", done, call(opExtend, t0+s, 3, "tok"), hOutput{lost: true}, []string{"done fence 3"}},
		{"extend keeps the fence and moves the lease", held, call(opExtend, t0+s, 3, "tok"), hOutput{expiry: t0 + s + lease},
			[]string{"claimed fence 3, lease until T+11s"}},
	} {
		t.Run(strings.ReplaceAll(tc.name, " ", "_"), func(t *testing.T) {
			var got []string
			for _, st := range m.step(tc.from, tc.in, tc.out) {
				got = append(got, m.describeState(st.(rec)))
			}
			if len(got) != len(tc.want) {
				t.Fatalf("%s from %s: successors %q, want %q", m.describeOp(tc.in, tc.out), m.describeState(tc.from), got, tc.want)
			}
			for i, w := range tc.want {
				if !strings.HasPrefix(got[i], w) {
					t.Errorf("%s from %s: successor %d is %q, want %q...", m.describeOp(tc.in, tc.out), m.describeState(tc.from), i, got[i], w)
				}
			}
		})
	}
}
