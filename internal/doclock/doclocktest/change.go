package doclocktest

import (
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

func aStaleVersionIsFencedOutLikeAStaleFence(t *testing.T, drv h) {
	drv.Emulator(t)
	clock := NewClock()
	b, _ := drv.onClock(t, clock, Config{})
	ctx := t.Context()
	r1, _ := b.Claim(ctx, "k", time.Minute)
	clock.Advance(2 * time.Minute)
	r2, _ := b.Claim(ctx, "k", time.Minute)
	if r2.Outcome != store.Won || r2.Claim.Rev == r1.Claim.Rev {
		t.Fatalf("reclaim: %v rev %d (was %d)", r2.Outcome, r2.Claim.Rev, r1.Claim.Rev)
	}
	if ok, err := b.Complete(ctx, r1.Claim); ok || err != nil {
		t.Fatalf("zombie complete: %v %v, want false", ok, err)
	}
	// A stale version with the current fence (the claim was extended
	// through another copy) is re-read, not refused.
	ext, err := b.Extend(ctx, r2.Claim, time.Hour)
	if err != nil || ext.Rev == r2.Claim.Rev {
		t.Fatalf("extend: %v rev %d", err, ext.Rev)
	}
	if ok, err := b.Complete(ctx, r2.Claim); !ok || err != nil {
		t.Fatalf("complete with the current fence and an old version: %v %v", ok, err)
	}
	if r, _ := b.Claim(ctx, "k", time.Minute); r.Outcome != store.AlreadyDone {
		t.Fatalf("after complete: %v", r.Outcome)
	}
}

// An Extend whose write landed but whose reply was lost recognises its
// own write on the retry and does not extend a second time.
func extendWithALostReplyExtendsOnce(t *testing.T, drv h) {
	ctx := t.Context()
	a, ra, b, clock, held := drv.heldWithALostCommitNext(t)
	ra.WhileLost = func() { clock.Advance(time.Second) }
	start := clock.Now()
	ext, err := a.Extend(ctx, held, time.Hour)
	if err != nil || !ext.LeaseExpiry.Equal(start.Add(time.Hour)) {
		t.Fatalf("extend: %v until %v, want until %v (the write that landed, not a second one)", err, ext.LeaseExpiry, start.Add(time.Hour))
	}
	if h, _ := b.Claim(ctx, "k", time.Minute); h.Outcome != store.HeldByOther || !h.Until.Equal(ext.LeaseExpiry) {
		t.Fatalf("claim: %v until %v, want held until %v", h.Outcome, h.Until, ext.LeaseExpiry)
	}
}

// A Complete whose write applied but whose reply was lost, and whose
// retries outlast the ttl, finds the record reclaimed by another: it
// cannot tell whether it completed, so it returns an error, not false.
func completeRetriedPastItsTTLCannotTellAndFails(t *testing.T, drv h) {
	ctx := t.Context()
	a, ra, b, clock, held := drv.heldWithALostCommitNext(t)
	ra.WhileLost = func() {
		clock.Advance(a.TTL() + time.Second)
		if r, err := b.Claim(ctx, "k", time.Minute); err != nil || r.Outcome != store.Won {
			t.Errorf("the other instance's claim: %v %v", r.Outcome, err)
		}
	}
	ok, err := a.Complete(ctx, held)
	if err == nil {
		t.Fatalf("complete whose lost write applied, then expired and was reclaimed: %v; want an error (it cannot tell)", ok)
	}
	t.Logf("complete: %v", err)
}

// A Complete whose versioned update misses because the record is gone
// (deleted after its expires-at) reports false, not true.
func completeOfAPurgedRecordIsFalse(t *testing.T, drv h) {
	drv.Emulator(t)
	ctx := t.Context()
	clock := NewClock()
	b, _ := drv.onClock(t, clock, Config{})
	r, _ := b.Claim(ctx, "k", time.Minute)
	clock.Advance(time.Minute + b.TTL() + time.Second)
	if n, err := b.PurgeExpired(ctx, 0); n != 1 || err != nil {
		t.Fatalf("purge: %d %v", n, err)
	}
	if ok, err := b.Complete(ctx, r.Claim); ok || err != nil {
		t.Fatalf("complete of a purged record: %v %v, want false", ok, err)
	}
	// A fresh record starts at fence 1 again; the old claim, also fence 1,
	// is told apart by its token and cannot complete it.
	fresh, _ := b.Claim(ctx, "k", time.Minute)
	if fresh.Claim.Fence != 1 {
		t.Fatalf("fresh record: fence %d", fresh.Claim.Fence)
	}
	if ok, err := b.Complete(ctx, r.Claim); ok || err != nil {
		t.Fatalf("complete of the old claim over a fresh record with the same fence: %v %v, want false", ok, err)
	}
	if r, _ := b.Claim(ctx, "k", time.Minute); r.Outcome != store.HeldByOther {
		t.Fatalf("fresh record after the old claim's complete: %v, want held by other", r.Outcome)
	}
}

func init() {
	add(
		testCase{"AStaleVersionIsFencedOutLikeAStaleFence", aStaleVersionIsFencedOutLikeAStaleFence},
		testCase{"ExtendWithALostReplyExtendsOnce", extendWithALostReplyExtendsOnce},
		testCase{"CompleteRetriedPastItsTTLCannotTellAndFails", completeRetriedPastItsTTLCannotTellAndFails},
		testCase{"CompleteOfAPurgedRecordIsFalse", completeOfAPurgedRecordIsFalse},
	)
}
