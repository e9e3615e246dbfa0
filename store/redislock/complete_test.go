package redislock_test

import (
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A claim whose token is the holder's followed by a comma and more is not
// the holder's claim (the port: Complete acts only on a record whose fence
// and token both match): Complete leaves the holder's record alone and
// reports false, and on a done record whose token and fingerprint spell
// that token it reports false too, for that record is not done with it.
func TestCompleteWithATokenThatExtendsTheHoldersByACommaIsNotTheHolder(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	ctx := t.Context()
	r, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim: %v %v", r, err)
	}
	forged := r.Claim
	forged.Token = r.Claim.Token + ",fp"
	if ok, err := b.Complete(ctx, forged); ok || err != nil {
		t.Fatalf("complete with the token %q on a record held by %q: %v %v; want false, nil", forged.Token, r.Claim.Token, ok, err)
	}
	if got := readRecord(t, c, prefixOf(b)+"k"); got.State != "c" || got.Token != r.Claim.Token || got.Fingerprint != "" {
		t.Fatalf("the holder's record after a forged complete: %+v; want still claimed by %q", got, r.Claim.Token)
	}
	if ok, err := b.CompleteFingerprint(ctx, r.Claim, "fp"); !ok || err != nil {
		t.Fatalf("the holder's complete: %v %v", ok, err)
	}
	if ok, err := b.Complete(ctx, forged); ok || err != nil {
		t.Fatalf("complete with the token %q on a record done by %q with fingerprint fp: %v %v; want false, nil", forged.Token, r.Claim.Token, ok, err)
	}
}

// A claim no Claim returns, with a negative fence, is stale like any
// other whose fence the record does not have: Complete reports false, not
// an error.
func TestCompleteWithANegativeFenceIsStaleNotAnError(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	ctx := t.Context()
	r, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim: %v %v", r, err)
	}
	for _, fence := range []int64{-1, -r.Claim.Fence} {
		forged := r.Claim
		forged.Fence = fence
		if ok, err := b.Complete(ctx, forged); ok || err != nil {
			t.Fatalf("complete with fence %d: %v %v; want false, nil", fence, ok, err)
		}
	}
	if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
		t.Fatalf("the holder's complete: %v %v", ok, err)
	}
}
