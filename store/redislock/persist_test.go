package redislock_test

import (
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A done record whose key lost its expiry (an operator ran PERSIST on it,
// or copied it without its TTL) never reaches its expires-at: it stays
// done, reported with an unknown Until, rather than reclaimable at once.
// The expires-at of a done record lives only in its key's expiry
// (PEXPIRETIME, -1 here), and reading -1 as an instant long past let the
// next delivery win the key and run the work a second time.
func TestADoneKeyWithoutAnExpiryStaysDone(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	ctx := t.Context()
	r, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatal(r.Outcome, err)
	}
	if ok, err := b.CompleteFingerprint(ctx, r.Claim, "fp"); !ok || err != nil {
		t.Fatal(ok, err)
	}
	if ok, err := c.Persist(ctx, prefixOf(b)+"k").Result(); !ok || err != nil {
		t.Fatal(ok, err)
	}
	got, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || got.Outcome != store.AlreadyDone || !got.Until.IsZero() || got.Fingerprint != "fp" {
		t.Fatalf("claim of a done key without an expiry: %v fence %d until %v fingerprint %q %v; want already done, until unknown, fingerprint fp",
			got.Outcome, got.Claim.Fence, got.Until, got.Fingerprint, err)
	}
}
