package doclocktest

import (
	"fmt"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// PurgeExpired deletes by the server's clock: a purger whose clock runs
// hours ahead deletes nothing before its expires-at, and one whose clock
// runs behind still deletes what has expired.
func serverClockPurgesNothingEarly(t *testing.T, drv h) {
	drv.Emulator(t)
	for name, off := range map[string]time.Duration{"purger_ahead": Skew, "purger_behind": -Skew} {
		t.Run(name, func(t *testing.T) {
			ctx := t.Context()
			server, holder, purger := drv.twoOnServer(t, 0, off)
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

// PurgeExpired removes every expired record, in batches (of 500), also
// when the service answers a query with fewer results than asked for and
// more to come (the Datastore emulator returns at most 300 a batch; the
// purge stopped after the first).
func purgeExpiredRemovesEveryExpiredRecord(t *testing.T, drv h) {
	drv.Emulator(t)
	ns := drv.Space()
	b, _ := drv.New(t, Config{Space: ns})
	SeedExpired(t, drv, ns, 700)
	if n, err := b.PurgeExpired(t.Context(), 0); n != 700 || err != nil {
		t.Fatalf("purge: %d deleted, %v; want 700", n, err)
	}
	if n, err := b.PurgeExpired(t.Context(), 0); n != 0 || err != nil {
		t.Fatalf("second purge: %d deleted, %v; want 0", n, err)
	}
}

// PurgeExpired deletes a record whose expires_at is the earliest instant
// Go's time.Time has (0001-01-01T00:00:00Z, time.Time{}, which a writer of
// the zero time stores): it expired long ago, as the purge before issue
// 30 judged it. A full batch of them (which the query, ordered by
// expires_at, returns first) must not stop the purge either: it deletes
// them and the record that expired an hour ago after them.
func purgeExpiredDeletesRecordsThatExpiredAtYearOne(t *testing.T, drv h) {
	drv.Emulator(t)
	ns := drv.Space()
	b, _ := drv.New(t, Config{Space: ns})
	recs := make([]Raw, doclock.PurgeBatch)
	for i := range recs {
		recs[i] = Raw{Key: fmt.Sprintf("year-one-%d", i), State: 2, Fence: 1, Token: "t"}
	}
	drv.PutRaw(t, ns, recs...)
	SeedExpired(t, drv, ns, 1)
	if n, err := b.PurgeExpired(t.Context(), 0); n != doclock.PurgeBatch+1 || err != nil {
		t.Fatalf("purge: %d deleted, %v; want %d (the records that expired at year 1, and the one an hour ago)", n, err, doclock.PurgeBatch+1)
	}
	if n, err := b.PurgeExpired(t.Context(), 0); n != 0 || err != nil {
		t.Fatalf("second purge: %d deleted, %v; want 0", n, err)
	}
}

func init() {
	add(
		testCase{"ServerClockPurgesNothingEarly", serverClockPurgesNothingEarly},
		testCase{"PurgeExpiredRemovesEveryExpiredRecord", purgeExpiredRemovesEveryExpiredRecord},
		testCase{"PurgeExpiredDeletesRecordsThatExpiredAtYearOne", purgeExpiredDeletesRecordsThatExpiredAtYearOne},
	)
}

// SeedExpired writes n records into space (through d) that expired an hour
// ago.
func SeedExpired(t testing.TB, d Driver, space string, n int) {
	t.Helper()
	past := time.Now().Add(-time.Hour)
	recs := make([]Raw, n)
	for i := range recs {
		recs[i] = Raw{Key: fmt.Sprintf("expired-%d", i), State: 2, Fence: 1, Lease: past, Exp: past, Token: "t"}
	}
	d.PutRaw(t, space, recs...)
}
