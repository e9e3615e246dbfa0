package redislock_test

import (
	"math"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// A lease or ttl at the top of time.Duration's range (math.MaxInt64, the
// usual spelling of "forever", which the port accepts) is a long one: the
// record it writes expires centuries ahead, not in the past. Rounding it
// up to whole milliseconds once overflowed to a negative count: Claim then
// failed on an invalid expiry, or, with a ttl above about 235 years, set
// the key to expire in 1985, so that Redis dropped it at once and a second
// caller won the key beside the first.
func TestDurationsAtTheirLimitNeverSetAnExpiryInThePast(t *testing.T) {
	const forever = time.Duration(math.MaxInt64)
	c := client(t, testsvc.Redis(t))
	ctx := t.Context()
	for _, tc := range []struct {
		name       string
		lease, ttl time.Duration
	}{
		{"lease forever", forever, time.Hour},
		{"ttl forever", time.Minute, forever},
		{"lease forever, ttl 250 years", forever, 250 * 365 * 24 * time.Hour},
		{"both forever", forever, forever},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newBackend(t, c, redislock.WithTTL(tc.ttl))
			raw := prefixOf(b) + "k"
			now := serverNow(t, c).Truncate(time.Millisecond) // the scripts count whole ms
			// The expiries the port asks for, capped at 200 years (every
			// case's lease and ttl are at least a minute, and the forever
			// ones more than 290 years).
			far := func(d time.Duration) time.Time { return now.Add(min(d, 200*365*24*time.Hour)) }
			expiry := func() time.Time {
				// Not PExpireTime: its time.Duration overflows this far out.
				ms, err := c.Do(ctx, "PEXPIRETIME", raw).Int64()
				if err != nil {
					t.Fatal(err)
				}
				return time.UnixMilli(ms)
			}

			r, err := b.Claim(ctx, "k", tc.lease)
			if err != nil || r.Outcome != store.Won {
				t.Fatalf("claim: %v %v; want won", r.Outcome, err)
			}
			if r.Claim.LeaseExpiry.Before(far(tc.lease)) {
				t.Fatalf("lease expiry %v, want %v or later", r.Claim.LeaseExpiry, far(tc.lease))
			}
			if e := expiry(); e.Before(r.Claim.LeaseExpiry) {
				t.Fatalf("Redis deletes the claimed record at %v, before its lease expiry %v", e, r.Claim.LeaseExpiry)
			}
			if other, err := b.Claim(ctx, "k", tc.lease); err != nil || other.Outcome != store.HeldByOther {
				t.Fatalf("a second caller: %v fence %d %v; want held by other", other.Outcome, other.Claim.Fence, err)
			}
			ext, err := b.Extend(ctx, r.Claim, tc.lease)
			if err != nil || ext.LeaseExpiry.Before(far(tc.lease)) {
				t.Fatalf("extend: lease expiry %v %v; want %v or later", ext.LeaseExpiry, err, far(tc.lease))
			}
			if ok, err := b.Complete(ctx, ext); !ok || err != nil {
				t.Fatalf("complete: %v %v", ok, err)
			}
			d, err := b.Claim(ctx, "k", tc.lease)
			if err != nil || d.Outcome != store.AlreadyDone || d.Until.Before(far(tc.ttl)) {
				t.Fatalf("claim of the done key: %v until %v %v; want already done until %v or later", d.Outcome, d.Until, err, far(tc.ttl))
			}
		})
	}
}
