package datastorelock_test

import (
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
)

// The port: while now < lease expiry a Claim answers HeldByOther, and the
// LeaseExpiry a claim reports is the one stored. Datastore keeps
// timestamps in whole microseconds; a lease (or ttl) with a fraction of a
// microsecond must not be stored a fraction earlier than the LeaseExpiry
// its holder was given, or a racing Claim takes the key while the
// holder's lease is live by the holder's own reckoning.
func TestLeaseNeverEndsBeforeItsReportedExpirySubMicrosecondLeases(t *testing.T) {
	testsvc.Datastore(t)
	start := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	for _, lease := range []time.Duration{1500 * time.Nanosecond, time.Millisecond + 1, time.Second + 999} {
		clock := fake.NewClock(start)
		b, _ := newBackend(t, datastorelock.WithClock(clock.Now), datastorelock.WithTTL(time.Hour+1))
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
