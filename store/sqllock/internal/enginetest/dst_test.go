package enginetest

import (
	"fmt"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// Issue 9, defect 2: MySQL/MariaDB computed "now" as UNIX_TIMESTAMP(NOW(3)),
// which reads the session's wall clock back through the session time zone:
// in the hour a DST change repeats, that is an hour off. Under a server in
// Europe/Berlin (time_zone SYSTEM, as on a self-managed host with a local
// zone) and a session clock pinned with SET timestamp, every instant around
// both of 2025's changes must be read as itself: a key completed 25 minutes
// earlier with a 1 h ttl stays done, a live lease is not taken over, and
// PurgeExpired leaves a record alone before its expires-at.
func TestMySQLClockIgnoresTheSessionTimeZoneAcrossDST(t *testing.T) {
	_, base := testsvc.StartMariaDBInZone(t, "Europe/Berlin")
	// One connection, so the pinned session clock is the backend's.
	db := mariadb.open(t, createDatabase(t, base, "idem_dst"), nil)
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	const ttl = time.Hour
	b := mariadb.backend(t, db, sqllock.WithTTL(ttl))
	table := tableOf(b)
	ctx := t.Context()

	var zone, tz string
	if err := db.QueryRow("SELECT @@system_time_zone, @@time_zone").Scan(&zone, &tz); err != nil {
		t.Fatal(err)
	}
	if tz != "SYSTEM" || (zone != "CET" && zone != "CEST") {
		t.Fatalf("server zone %q, session time_zone %q; want CET or CEST and SYSTEM", zone, tz)
	}
	pin := func(at time.Time) {
		t.Helper()
		if _, err := db.Exec(fmt.Sprintf("SET timestamp = %d", at.Unix())); err != nil {
			t.Fatal(err)
		}
	}
	exists := func(key string) bool {
		t.Helper()
		var n int
		if err := db.QueryRow("SELECT COUNT(*) FROM "+table+" WHERE idem_key = ?", []byte(key)).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	}

	transitions := map[string]time.Time{
		"fall back": time.Date(2025, 10, 26, 1, 0, 0, 0, time.UTC), // 03:00 CEST -> 02:00 CET
		"spring":    time.Date(2025, 3, 30, 1, 0, 0, 0, time.UTC),  // 02:00 CET -> 03:00 CEST
	}
	for name, change := range transitions {
		for off := -90 * time.Minute; off <= 90*time.Minute; off += 5 * time.Minute {
			at := change.Add(off)
			later := at.Add(25 * time.Minute)
			label := fmt.Sprintf("%s: %s UTC", name, at.Format("2006-01-02 15:04"))

			// The backend's now is the pinned instant.
			pin(at)
			probe, err := b.Claim(ctx, "probe "+label, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if got := probe.Claim.LeaseExpiry.Add(-time.Minute); !got.Equal(at) {
				t.Errorf("%s: the backend reads now as %s UTC (%v off)", label, got.UTC().Format("15:04:05.000"), got.Sub(at))
			}

			// A key completed at `at` is still done 25 minutes later, and
			// another (that nobody claims again) is still there.
			done, kept := "done "+label, "kept "+label
			for _, k := range []string{done, kept} {
				r, err := b.Claim(ctx, k, time.Minute)
				if err != nil || r.Outcome != store.Won {
					t.Fatalf("%s: claim: %v %v", label, r.Outcome, err)
				}
				if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
					t.Fatalf("%s: complete: %v %v", label, ok, err)
				}
			}
			// A lease of 30 minutes taken at `at` is still live 25 minutes later.
			held := "held " + label
			h, err := b.Claim(ctx, held, 30*time.Minute)
			if err != nil || h.Outcome != store.Won {
				t.Fatalf("%s: claim: %v %v", label, h.Outcome, err)
			}

			pin(later)
			if again, err := b.Claim(ctx, done, time.Minute); err != nil || again.Outcome != store.AlreadyDone {
				t.Errorf("%s: a key completed 25 minutes earlier with a 1 h ttl: %v %v, want already done", label, again.Outcome, err)
			}
			if other, err := b.Claim(ctx, held, time.Minute); err != nil || other.Outcome != store.HeldByOther {
				t.Errorf("%s: a 30-minute lease taken 25 minutes earlier: %v (fence %d) %v, want held by other", label, other.Outcome, other.Claim.Fence, err)
			}
			if _, err := b.PurgeExpired(ctx, 0); err != nil {
				t.Fatalf("%s: purge: %v", label, err)
			}
			if !exists(kept) || !exists(done) || !exists(held) {
				t.Errorf("%s: PurgeExpired 25 minutes later deleted a record before its expires-at", label)
			}
		}
	}

	// Unpinned, the backend's now is this machine's (both read the host clock).
	if _, err := db.Exec("SET timestamp = DEFAULT"); err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	r, err := b.Claim(ctx, "unpinned", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if now := r.Claim.LeaseExpiry.Add(-time.Minute); now.Before(before.Add(-time.Second)) || now.After(time.Now().Add(time.Second)) {
		t.Errorf("unpinned, the backend reads now as %v; the host says %v", now, before)
	}
}
