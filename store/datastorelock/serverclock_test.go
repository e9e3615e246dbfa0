package datastorelock_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
)

// Two instances whose clocks are off the server's by skew (hours: more
// than a lease and more than a ttl), in each direction.
var skews = []struct {
	name          string
	holder, other time.Duration
}{
	{"holder_behind_other_ahead", -skew, skew},
	{"holder_ahead_other_behind", skew, -skew},
	{"holder_on_time_other_ahead", 0, skew},
	{"holder_behind_other_on_time", -skew, 0},
}

const (
	scLease = time.Minute
	scTTL   = 10 * time.Minute
)

// onServer returns a backend whose replies carry server's time (as the
// production service's do; the emulator's carry none) and whose own clock
// is off it by off.
func onServer(t *testing.T, server *fake.Clock, ns string, off time.Duration) *datastorelock.Backend {
	t.Helper()
	b, _ := newBackendVia(t, link{server: server.Now},
		datastorelock.WithNamespace(ns), datastorelock.WithTTL(scTTL), datastorelock.WithClock(skewed(server, off)))
	return b
}

func newServerClock() *fake.Clock {
	return fake.NewClock(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC))
}

// The lease a claim stores and reports runs from the server's now, and
// only the server's clock ends it: a fast instance cannot take a live key,
// a slow one can take a lapsed key, and a slow holder does not store a
// lease that has lapsed already.
func TestServerClockKeepsALiveLeaseHeld(t *testing.T) {
	testsvc.Datastore(t)
	for _, sk := range skews {
		t.Run(sk.name, func(t *testing.T) {
			ctx := t.Context()
			server := newServerClock()
			ns := namespace()
			holder, other := onServer(t, server, ns, sk.holder), onServer(t, server, ns, sk.other)
			start := server.Now()
			r, err := holder.Claim(ctx, "k", scLease)
			if err != nil || r.Outcome != store.Won {
				t.Fatalf("claim: %v %v", r.Outcome, err)
			}
			if want := start.Add(scLease); !r.Claim.LeaseExpiry.Equal(want) {
				t.Fatalf("lease expiry %v, want the server's now + lease %v", r.Claim.LeaseExpiry, want)
			}
			server.Advance(scLease - time.Second)
			for name, b := range map[string]*datastorelock.Backend{"other": other, "holder's own backend": holder} {
				h, err := b.Claim(ctx, "k", scLease)
				if err != nil || h.Outcome != store.HeldByOther || !h.Until.Equal(r.Claim.LeaseExpiry) {
					t.Fatalf("%s's claim a second before the lease ends: %v until %v, %v; want held by other until %v",
						name, h.Outcome, h.Until, err, r.Claim.LeaseExpiry)
				}
			}
			server.Advance(time.Second)
			next, err := other.Claim(ctx, "k", scLease)
			if err != nil || next.Outcome != store.Won || next.Claim.Fence != 2 {
				t.Fatalf("claim when the lease ends by the server's clock: %v fence %d, %v; want won with fence 2",
					next.Outcome, next.Claim.Fence, err)
			}
			if want := server.Now().Add(scLease); !next.Claim.LeaseExpiry.Equal(want) {
				t.Fatalf("reclaimed lease expiry %v, want %v", next.Claim.LeaseExpiry, want)
			}
			if ok, err := holder.Complete(ctx, r.Claim); ok || err != nil {
				t.Fatalf("replaced holder's complete: %v %v, want false", ok, err)
			}
			if ok, err := other.Complete(ctx, next.Claim); !ok || err != nil {
				t.Fatalf("new holder's complete: %v %v", ok, err)
			}
		})
	}
}

// A Done key suppresses duplicates for the ttl by the server's clock,
// whatever the clocks of the instances that completed and that ask.
func TestServerClockKeepsADoneKeyDoneForTheTTL(t *testing.T) {
	testsvc.Datastore(t)
	for _, sk := range skews {
		t.Run(sk.name, func(t *testing.T) {
			ctx := t.Context()
			server := newServerClock()
			ns := namespace()
			holder, other := onServer(t, server, ns, sk.holder), onServer(t, server, ns, sk.other)
			r, err := holder.Claim(ctx, "k", scLease)
			if err != nil || r.Outcome != store.Won {
				t.Fatalf("claim: %v %v", r.Outcome, err)
			}
			server.Advance(scLease / 2)
			completed := server.Now()
			if ok, err := holder.Complete(ctx, r.Claim); !ok || err != nil {
				t.Fatalf("complete: %v %v", ok, err)
			}
			server.Advance(scTTL - time.Second)
			for name, b := range map[string]*datastorelock.Backend{"other": other, "holder's own backend": holder} {
				d, err := b.Claim(ctx, "k", scLease)
				if err != nil || d.Outcome != store.AlreadyDone || !d.Until.Equal(completed.Add(scTTL)) {
					t.Fatalf("%s's claim a second before the ttl ends: %v until %v, %v; want already done until %v",
						name, d.Outcome, d.Until, err, completed.Add(scTTL))
				}
			}
			server.Advance(time.Second)
			again, err := other.Claim(ctx, "k", scLease)
			if err != nil || again.Outcome != store.Won || again.Claim.Fence != 2 {
				t.Fatalf("claim when the ttl ends by the server's clock: %v fence %d, %v; want won with fence 2",
					again.Outcome, again.Claim.Fence, err)
			}
		})
	}
}

// PurgeExpired deletes by the server's clock: a purger whose clock runs
// hours ahead deletes nothing before its expires-at, and one whose clock
// runs behind still deletes what has expired.
func TestServerClockPurgesNothingEarly(t *testing.T) {
	testsvc.Datastore(t)
	for name, off := range map[string]time.Duration{"purger_ahead": skew, "purger_behind": -skew} {
		t.Run(name, func(t *testing.T) {
			ctx := t.Context()
			server := newServerClock()
			ns := namespace()
			holder, purger := onServer(t, server, ns, 0), onServer(t, server, ns, off)
			d, _ := holder.Claim(ctx, "done", scLease)
			if ok, err := holder.Complete(ctx, d.Claim); !ok || err != nil {
				t.Fatalf("complete: %v %v", ok, err)
			}
			if h, _ := holder.Claim(ctx, "held", scLease); h.Outcome != store.Won {
				t.Fatalf("claim: %v", h.Outcome)
			}
			server.Advance(scTTL - time.Second)
			if n, err := purger.PurgeExpired(ctx, 0); n != 0 || err != nil {
				t.Fatalf("purge a second before the done key's ttl ends: %d deleted, %v; want 0", n, err)
			}
			if r, _ := holder.Claim(ctx, "done", scLease); r.Outcome != store.AlreadyDone {
				t.Fatalf("done key after the early purge: %v, want already done", r.Outcome)
			}
			server.Advance(time.Second)
			if n, err := purger.PurgeExpired(ctx, 0); n != 1 || err != nil {
				t.Fatalf("purge when the done key's ttl ends: %d deleted, %v; want 1 (not the claimed key, which lives a lease longer)", n, err)
			}
			if r, _ := holder.Claim(ctx, "done", scLease); r.Outcome != store.Won || r.Claim.Fence != 1 {
				t.Fatalf("done key after the purge: %v fence %d, want won with fence 1 (a fresh record)", r.Outcome, r.Claim.Fence)
			}
			if r, _ := holder.Claim(ctx, "held", scLease); r.Outcome != store.Won || r.Claim.Fence != 2 {
				t.Fatalf("lapsed claimed key: %v fence %d, want won with fence 2 (kept, not purged)", r.Outcome, r.Claim.Fence)
			}
		})
	}
}

// A release makes the key reclaimable at once by the server's clock, and
// an extension runs from the server's now, whatever the releasing or
// extending instance's clock says.
func TestServerClockReleaseAndExtend(t *testing.T) {
	testsvc.Datastore(t)
	for _, sk := range skews {
		t.Run(sk.name, func(t *testing.T) {
			ctx := t.Context()
			server := newServerClock()
			ns := namespace()
			holder, other := onServer(t, server, ns, sk.holder), onServer(t, server, ns, sk.other)
			r, _ := holder.Claim(ctx, "k", scLease)
			if err := holder.Release(ctx, r.Claim); err != nil {
				t.Fatal(err)
			}
			next, err := other.Claim(ctx, "k", scLease)
			if err != nil || next.Outcome != store.Won || next.Claim.Fence != 3 {
				t.Fatalf("claim right after a release: %v fence %d, %v; want won with fence 3", next.Outcome, next.Claim.Fence, err)
			}
			server.Advance(scLease / 2)
			ext, err := other.Extend(ctx, next.Claim, scLease)
			if err != nil || !ext.LeaseExpiry.Equal(server.Now().Add(scLease)) {
				t.Fatalf("extend: expiry %v, %v; want the server's now + lease %v", ext.LeaseExpiry, err, server.Now().Add(scLease))
			}
			server.Advance(scLease - time.Second)
			if h, _ := holder.Claim(ctx, "k", scLease); h.Outcome != store.HeldByOther {
				t.Fatalf("claim a second before the extended lease ends: %v, want held by other", h.Outcome)
			}
		})
	}
}

// When the only recent server timestamps came from requests that were slow
// to arrive (here: replies that report a time ten minutes ahead), the
// estimate runs ahead; the insert's own commit time shows it, and the claim
// reports an unknown outcome rather than a lease from an instant after the
// call.
func TestServerClockEstimateThatRanAheadIsNotHandedOut(t *testing.T) {
	testsvc.Datastore(t)
	ctx := t.Context()
	server := newServerClock()
	var ahead atomic.Int32
	stamp := func() time.Time {
		if ahead.Add(-1) >= 0 {
			return server.Now().Add(10 * time.Minute)
		}
		return server.Now()
	}
	b, _ := newBackendVia(t, link{server: stamp}, datastorelock.WithClock(server.Now))
	if r, err := b.Claim(ctx, "warm-up", scLease); err != nil || r.Outcome != store.Won {
		t.Fatalf("warm-up: %v %v", r.Outcome, err)
	}
	server.Advance(2 * time.Minute) // the estimate is stale
	ahead.Store(2)                  // the purge's two replies are ten minutes ahead
	if _, err := b.PurgeExpired(ctx, 0); err != nil {
		t.Fatal(err)
	}
	r, err := b.Claim(ctx, "k", scLease)
	if err == nil {
		t.Fatalf("claim: %v until %v (server now %v); want an unknown outcome", r.Outcome, r.Claim.LeaseExpiry, server.Now())
	}
	t.Logf("claim: %v", err)
	// A claim judged by a fresh read's own time is placed right.
	r, err = b.Claim(ctx, "k2", scLease)
	if err != nil || r.Outcome != store.Won || !r.Claim.LeaseExpiry.Equal(server.Now().Add(scLease)) {
		t.Fatalf("next claim: %v until %v, %v; want won until %v", r.Outcome, r.Claim.LeaseExpiry, err, server.Now().Add(scLease))
	}
}
