package doclocktest

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A Done record keeps the fingerprint its completion stored, Claim reports
// it until the record is reclaimed, a second completion by the same claim
// changes nothing, and a reclaim starts without one.
func fingerprintIsKeptUntilTheRecordIsReclaimed(t *testing.T, drv h) {
	drv.Emulator(t)
	ctx := t.Context()
	clock := NewClock()
	b, _ := drv.onClock(t, clock, Config{})
	r, _ := b.Claim(ctx, "k", time.Minute)
	if ok, err := b.CompleteFingerprint(ctx, r.Claim, "sha256:aa"); !ok || err != nil {
		t.Fatalf("complete with a fingerprint: %v %v", ok, err)
	}
	if ok, err := b.CompleteFingerprint(ctx, r.Claim, "sha256:bb"); !ok || err != nil {
		t.Fatalf("second complete by the same claim: %v %v, want true", ok, err)
	}
	if d, err := b.Claim(ctx, "k", time.Minute); err != nil || d.Outcome != store.AlreadyDone || d.Fingerprint != "sha256:aa" {
		t.Fatalf("claim of the done key: %v fingerprint %q, %v; want already done with the first completion's sha256:aa",
			d.Outcome, d.Fingerprint, err)
	}
	clock.Advance(b.TTL() + time.Second)
	again, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || again.Outcome != store.Won || again.Claim.Fence != 2 {
		t.Fatalf("reclaim after the ttl: %v fence %d, %v", again.Outcome, again.Claim.Fence, err)
	}
	if ok, err := b.Complete(ctx, again.Claim); !ok || err != nil {
		t.Fatalf("complete without a fingerprint: %v %v", ok, err)
	}
	if d, _ := b.Claim(ctx, "k", time.Minute); d.Outcome != store.AlreadyDone || d.Fingerprint != "" {
		t.Fatalf("after a reclaim completed without one: %v fingerprint %q, want none", d.Outcome, d.Fingerprint)
	}
}

// An invalid fingerprint is refused before any RPC.
func invalidFingerprintSendsNothing(t *testing.T, drv h) {
	drv.Emulator(t)
	ctx := t.Context()
	b, r := drv.New(t, Config{})
	c, _ := b.Claim(ctx, "k", time.Minute)
	r.Take()
	for _, fp := range []string{strings.Repeat("f", store.MaxFingerprintLen+1), "a\x00b", "\xff"} {
		if ok, err := b.CompleteFingerprint(ctx, c.Claim, fp); ok || !errors.Is(err, store.ErrInvalidFingerprint) {
			t.Fatalf("fingerprint %q: %v %v, want ErrInvalidFingerprint", fp, ok, err)
		}
	}
	if calls := r.Take(); len(calls) != 0 {
		t.Fatalf("invalid fingerprints sent %v", calls)
	}
	if h, _ := b.Claim(ctx, "k", time.Minute); h.Outcome != store.HeldByOther {
		t.Fatalf("after refused completes: %v, want still held", h.Outcome)
	}
}

// Records written without the fingerprint property (before it existed)
// keep working: a Done one is already done with no fingerprint, and a
// claim held on a Claimed one completes with one.
func recordsWithoutAFingerprintKeepWorking(t *testing.T, drv h) {
	drv.Emulator(t)
	ctx := t.Context()
	clock := NewClock()
	ns := drv.Space()
	b, _ := drv.onClock(t, clock, Config{Space: ns})
	now := clock.Now()
	drv.PutRaw(t, ns, Raw{"done", 2, 3, now.Add(-time.Minute), now.Add(time.Hour), "old-token"})
	if d, err := b.Claim(ctx, "done", time.Minute); err != nil || d.Outcome != store.AlreadyDone || d.Fingerprint != "" ||
		!d.Until.Equal(now.Add(time.Hour)) {
		t.Fatalf("claim of an old done record: %v until %v fingerprint %q, %v; want already done, none", d.Outcome, d.Until, d.Fingerprint, err)
	}
	drv.PutRaw(t, ns, Raw{"held", 1, 5, now.Add(time.Minute), now.Add(time.Hour), "holder"})
	held := store.Claim{Key: "held", Fence: 5, Token: "holder", LeaseExpiry: now.Add(time.Minute)}
	if ok, err := b.CompleteFingerprint(ctx, held, "fp-1"); !ok || err != nil {
		t.Fatalf("complete of an old claimed record: %v %v", ok, err)
	}
	if d, _ := b.Claim(ctx, "held", time.Minute); d.Outcome != store.AlreadyDone || d.Fingerprint != "fp-1" {
		t.Fatalf("after completing it: %v fingerprint %q, want already done with fp-1", d.Outcome, d.Fingerprint)
	}
	clock.Advance(time.Hour)
	if w, err := b.Claim(ctx, "done", time.Minute); err != nil || w.Outcome != store.Won || w.Claim.Fence != 4 {
		t.Fatalf("reclaim of the old done record after its ttl: %v fence %d, %v; want won fence 4", w.Outcome, w.Claim.Fence, err)
	}
}

// A CompleteFingerprint whose write landed but whose reply was lost
// recognises its own write on the retry: true, the fingerprint stored
// once, the ttl from the write that landed.
func completeFingerprintWithALostReplyStoresItOnce(t *testing.T, drv h) {
	ctx := t.Context()
	a, ra, b, clock, held := drv.heldWithALostCommitNext(t)
	ra.WhileLost = func() { clock.Advance(time.Second) }
	start := clock.Now()
	if ok, err := a.CompleteFingerprint(ctx, held, "fp-lost"); !ok || err != nil {
		t.Fatalf("complete: %v %v", ok, err)
	}
	if ra.Lost.Load() != 1 {
		t.Fatalf("%d replies lost, want 1", ra.Lost.Load())
	}
	d, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || d.Outcome != store.AlreadyDone || d.Fingerprint != "fp-lost" || !d.Until.Equal(start.Add(a.TTL())) {
		t.Fatalf("claim: %v until %v fingerprint %q, %v; want already done until %v with fp-lost",
			d.Outcome, d.Until, d.Fingerprint, err, start.Add(a.TTL()))
	}
}

// A CompleteFingerprint whose lost write's retries outlast the ttl finds
// the record reclaimed: it cannot tell whether it completed, so it
// returns an error, not false.
func completeFingerprintRetriedPastItsTTLCannotTellAndFails(t *testing.T, drv h) {
	ctx := t.Context()
	a, ra, b, clock, held := drv.heldWithALostCommitNext(t)
	ra.WhileLost = func() {
		clock.Advance(a.TTL() + time.Second)
		if r, err := b.Claim(ctx, "k", time.Minute); err != nil || r.Outcome != store.Won {
			t.Errorf("the other instance's claim: %v %v", r.Outcome, err)
		}
	}
	if ok, err := a.CompleteFingerprint(ctx, held, "fp"); err == nil {
		t.Fatalf("complete whose lost write applied, then expired and was reclaimed: %v; want an error", ok)
	}
}

func init() {
	add(
		testCase{"FingerprintIsKeptUntilTheRecordIsReclaimed", fingerprintIsKeptUntilTheRecordIsReclaimed},
		testCase{"InvalidFingerprintSendsNothing", invalidFingerprintSendsNothing},
		testCase{"RecordsWithoutAFingerprintKeepWorking", recordsWithoutAFingerprintKeepWorking},
		testCase{"CompleteFingerprintWithALostReplyStoresItOnce", completeFingerprintWithALostReplyStoresItOnce},
		testCase{"CompleteFingerprintRetriedPastItsTTLCannotTellAndFails", completeFingerprintRetriedPastItsTTLCannotTellAndFails},
	)
}
