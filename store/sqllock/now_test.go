package sqllock_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// The port: a Claimed record is held while now < lease expiry, and a lease
// runs for its whole length from the backend's now. Every instant is kept
// in whole milliseconds, so "now" must be the database clock truncated to
// its millisecond, never rounded up: a now that runs half a millisecond
// ahead lets a racing Claim take a lease up to half a millisecond before
// the LeaseExpiry its holder was given (and makes a lease of 2 ms last
// barely 1 ms). Each engine's now expression is evaluated at pinned
// instants inside a millisecond.
func TestLeaseNeverEndsBeforeItsInstantNowIsTruncatedToTheMillisecond(t *testing.T) {
	base := time.Date(2026, 11, 30, 14, 0, 0, 0, time.UTC)
	for _, frac := range []time.Duration{0, 1 * time.Microsecond, 400 * time.Microsecond, 500 * time.Microsecond, 600 * time.Microsecond, 999 * time.Microsecond} {
		for _, ms := range []int{0, 1, 7, 123, 999} {
			at := base.Add(time.Duration(ms)*time.Millisecond + frac)
			want := at.UnixMilli()
			for _, e := range engines {
				db := e.open(t, e.dsn(t), nil)
				expr := sqllock.NowSQL(e.dialect)
				var q string
				switch e.name {
				case "postgres":
					q = "SELECT " + strings.ReplaceAll(expr, "clock_timestamp()", "'"+at.Format("2006-01-02 15:04:05.000000")+"+00'::timestamptz")
				case "mysql":
					db.SetMaxOpenConns(1)
					if _, err := db.Exec(fmt.Sprintf("SET timestamp = %d.%06d", at.Unix(), at.Nanosecond()/1000)); err != nil {
						t.Fatal(err)
					}
					q = "SELECT " + expr
				case "sqlite":
					q = "SELECT " + strings.ReplaceAll(expr, "'now'", "'"+at.Format("2006-01-02 15:04:05.000")+"'")
					want = at.Truncate(time.Millisecond).UnixMilli() // SQLite's clock has milliseconds
				}
				var got int64
				if err := db.QueryRow(q).Scan(&got); err != nil {
					t.Fatalf("%s: %s: %v", e.name, q, err)
				}
				if got != want {
					t.Errorf("%s: now at %s = %d ms, want %d (off by %d ms)", e.name, at.Format(time.RFC3339Nano), got, want, got-want)
				}
				db.Close()
			}
		}
	}
}
