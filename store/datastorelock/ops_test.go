package datastorelock_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
)

// Datastore's own (not in doclocktest): the jump must fall between
// ForceRelease's Lookup and its Commit, a hook that only this driver's
// interceptor has (Firestore reads by a stream).
//
// The backend's clock jumps hours ahead (a clock without a monotonic
// reading, stepped) between ForceRelease's Lookup and its Commit: the
// lease it carried forward from the read would end hours after the
// server's now. The released lease MUST end by the server's clock, so that
// the next Claim wins the key at once.
func TestForceReleaseAcrossAJumpOfTheClientClockEndsTheLeaseNow(t *testing.T) {
	testsvc.Datastore(t)
	server := newClock()
	ns := namespace()
	var jumped atomic.Int64 // the client's clock is ahead of server's by this
	var skip atomic.Int32   // calls of the clock before the jump takes effect
	var armed atomic.Bool
	client := func() time.Time {
		if armed.Load() && skip.Add(-1) < 0 {
			armed.Store(false)
			jumped.Store(int64(3 * time.Hour))
		}
		return server.Now().Add(time.Duration(jumped.Load()))
	}
	op, r := newBackendVia(t, link{server: server.Now}, datastorelock.WithNamespace(ns), datastorelock.WithClock(client))
	other := onServer(t, server, ns, 0)
	ctx := t.Context()
	if c, err := other.Claim(ctx, "k", time.Hour); err != nil || c.Outcome != store.Won {
		t.Fatalf("claim: %v %v", c.Outcome, err)
	}
	rec, _, err := op.Inspect(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	// The jump comes after the clock reads the Lookup's reply arrival.
	r.afterLookup = func() { r.afterLookup = nil; skip.Store(1); armed.Store(true) }
	if ok, err := op.ForceRelease(ctx, rec); !ok || err != nil {
		t.Fatalf("force-release: %v %v", ok, err)
	}
	if jumped.Load() == 0 {
		t.Fatal("the clock did not jump")
	}
	got, _, err := other.Inspect(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if !got.Reclaimable() {
		t.Fatalf("after the force-release the lease ends at %v, %v after the server's now %v", got.LeaseExpiry, got.LeaseExpiry.Sub(got.Now), got.Now)
	}
	if c, err := other.Claim(ctx, "k", time.Minute); err != nil || c.Outcome != store.Won {
		t.Fatalf("claim after the force-release: %v %v, want won", c.Outcome, err)
	}
}
