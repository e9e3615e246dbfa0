package doclocktest

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The lease a claim stores and reports runs from the server's now, and
// only the server's clock ends it: a fast instance cannot take a live key,
// a slow one can take a lapsed key, and a slow holder does not store a
// lease that has lapsed already.
func serverClockKeepsALiveLeaseHeld(t *testing.T, drv h) {
	drv.eachSkew(t, func(t *testing.T, server *fake.Clock, holder, other Backend) {
		ctx := t.Context()
		start := server.Now()
		r, err := holder.Claim(ctx, "k", scLease)
		if err != nil || r.Outcome != store.Won {
			t.Fatalf("claim: %v %v", r.Outcome, err)
		}
		if want := start.Add(scLease); !r.Claim.LeaseExpiry.Equal(want) {
			t.Fatalf("lease expiry %v, want the server's now + lease %v", r.Claim.LeaseExpiry, want)
		}
		server.Advance(scLease - time.Second)
		for name, b := range map[string]Backend{"other": other, "holder's own backend": holder} {
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

// A Done key suppresses duplicates for the ttl by the server's clock,
// whatever the clocks of the instances that completed and that ask.
func serverClockKeepsADoneKeyDoneForTheTTL(t *testing.T, drv h) {
	drv.eachSkew(t, func(t *testing.T, server *fake.Clock, holder, other Backend) {
		ctx := t.Context()
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
		for name, b := range map[string]Backend{"other": other, "holder's own backend": holder} {
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

// A release makes the key reclaimable at once by the server's clock, and
// an extension runs from the server's now, whatever the releasing or
// extending instance's clock says.
func serverClockReleaseAndExtend(t *testing.T, drv h) {
	drv.eachSkew(t, func(t *testing.T, server *fake.Clock, holder, other Backend) {
		ctx := t.Context()
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

// When the only recent server timestamps came from requests that were slow
// to arrive (here: replies that report a time ten minutes ahead), the
// estimate runs ahead; the create's own commit time shows it, and the claim
// reports an unknown outcome rather than a lease from an instant after the
// call.
func serverClockEstimateThatRanAheadIsNotHandedOut(t *testing.T, drv h) {
	drv.Emulator(t)
	ctx := t.Context()
	server := NewClock()
	var ahead atomic.Int32
	stamp := func() time.Time {
		if ahead.Add(-1) >= 0 {
			return server.Now().Add(10 * time.Minute)
		}
		return server.Now()
	}
	b, _ := drv.New(t, Config{Server: stamp, Clock: server.Now})
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

// The port: while now < lease expiry a Claim answers HeldByOther, and the
// LeaseExpiry a claim reports is the one stored. The services keep
// timestamps in whole microseconds; a lease (or ttl) with a fraction of a
// microsecond must not be stored a fraction earlier than the LeaseExpiry
// its holder was given, or a racing Claim takes the key while the
// holder's lease is live by the holder's own reckoning.
func leaseNeverEndsBeforeItsReportedExpirySubMicrosecondLeases(t *testing.T, drv h) {
	drv.Emulator(t)
	for _, lease := range []time.Duration{1500 * time.Nanosecond, time.Millisecond + 1, time.Second + 999} {
		clock := NewClock()
		b, _ := drv.onClock(t, clock, Config{TTL: time.Hour + 1})
		ctx := t.Context()
		r1, err := b.Claim(ctx, "k", lease)
		if err != nil || r1.Outcome != store.Won {
			t.Fatalf("lease %v: claim: %v %v", lease, r1, err)
		}
		// Just before the reported expiry, within its last microsecond.
		clock.Set(r1.Claim.LeaseExpiry.Add(-time.Nanosecond))
		r2, err := b.Claim(ctx, "k", lease)
		if err != nil {
			t.Fatal(err)
		}
		if r2.Outcome != store.HeldByOther {
			t.Errorf("lease %v: a claim at %v, before the holder's LeaseExpiry %v, answered %v",
				lease, clock.Now().Format(time.RFC3339Nano), r1.Claim.LeaseExpiry.Format(time.RFC3339Nano), r2.Outcome)
		}
	}
}

// When the server's clock jumps while a request is in flight (as the
// suite's driven clock does), that reply bounds the server's time only
// loosely: its upper bound runs ahead by the jump. A write must not base
// its instants on such an estimate (the Done record would carry a ttl
// from an instant after the call, visible to others before then): it
// reads first, and completes from the read's time.
func serverClockAWideEstimateIsReadPastNotWrittenFrom(t *testing.T, drv h) {
	drv.Emulator(t)
	ctx := t.Context()
	server := NewClock()
	const jumpBy = 5 * time.Minute
	var jump atomic.Bool
	stamp := func() time.Time {
		if jump.CompareAndSwap(true, false) {
			server.Advance(jumpBy) // after the request was sent, before the server stamps it
		}
		return server.Now()
	}
	coll := drv.Space()
	a, _ := drv.New(t, Config{Server: stamp, Space: coll, TTL: scTTL, Clock: server.Now})
	other, _ := drv.New(t, Config{Server: stamp, Space: coll, TTL: scTTL, Clock: server.Now})
	held, err := a.Claim(ctx, "k", 10*time.Minute)
	if err != nil || held.Outcome != store.Won {
		t.Fatalf("claim: %v %v", held.Outcome, err)
	}
	if r, err := other.Claim(ctx, "h", 10*time.Minute); err != nil || r.Outcome != store.Won {
		t.Fatalf("other's claim: %v %v", r.Outcome, err)
	}
	server.Advance(2 * time.Minute) // a's estimate is stale
	jump.Store(true)
	if r, err := a.Claim(ctx, "h", time.Minute); err != nil || r.Outcome != store.HeldByOther {
		t.Fatalf("claim of the other's key: %v %v", r.Outcome, err)
	}
	// a's only recent server time came from a request across the jump.
	ok, err := a.Complete(ctx, held.Claim)
	if !ok || err != nil {
		t.Fatalf("complete after a wide estimate: %v %v; want true", ok, err)
	}
	want := server.Now().Add(scTTL)
	if d, err := other.Claim(ctx, "k", time.Minute); err != nil || d.Outcome != store.AlreadyDone || !d.Until.Equal(want) {
		t.Fatalf("claim of the completed key: %v until %v, %v; want already done until %v (a ttl from the server's now)",
			d.Outcome, d.Until, err, want)
	}
}

func init() {
	add(
		testCase{"ServerClockKeepsALiveLeaseHeld", serverClockKeepsALiveLeaseHeld},
		testCase{"ServerClockKeepsADoneKeyDoneForTheTTL", serverClockKeepsADoneKeyDoneForTheTTL},
		testCase{"ServerClockReleaseAndExtend", serverClockReleaseAndExtend},
		testCase{"ServerClockEstimateThatRanAheadIsNotHandedOut", serverClockEstimateThatRanAheadIsNotHandedOut},
		testCase{"LeaseNeverEndsBeforeItsReportedExpirySubMicrosecondLeases", leaseNeverEndsBeforeItsReportedExpirySubMicrosecondLeases},
		testCase{"ServerClockAWideEstimateIsReadPastNotWrittenFrom", serverClockAWideEstimateIsReadPastNotWrittenFrom},
	)
}
