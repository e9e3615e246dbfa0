package enginetest

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store/internal/dialect"
)

// The port: a Claimed record is held while now < lease expiry, and a lease
// runs for its whole length from the backend's now. Every instant is kept
// in whole milliseconds, so "now" must be the database clock truncated to
// its millisecond, never rounded up: a now that runs half a millisecond
// ahead lets a racing Claim take a lease up to half a millisecond before
// the LeaseExpiry its holder was given (and makes a lease of 2 ms last
// barely 1 ms). Each engine's now expression is evaluated at pinned
// instants inside a millisecond (and SQLite's, whose julianday is a
// float, at every millisecond of two seconds).
func TestLeaseNeverEndsBeforeItsInstantNowIsTruncatedToTheMillisecond(t *testing.T) {
	base := time.Date(2026, 11, 30, 14, 0, 0, 0, time.UTC)
	for _, e := range engines {
		db := e.open(t, e.dsn(t), nil)
		db.SetMaxOpenConns(1) // MySQL: the pinned session clock is the query's
		expr := e.sql().Now
		for _, frac := range []time.Duration{0, 1 * time.Microsecond, 400 * time.Microsecond, 500 * time.Microsecond, 600 * time.Microsecond, 999 * time.Microsecond} {
			for _, ms := range []int{0, 1, 7, 123, 999} {
				at := base.Add(time.Duration(ms)*time.Millisecond + frac)
				want := at.UnixMilli()
				var q string
				switch e.name {
				case "postgres":
					q = "SELECT " + strings.ReplaceAll(expr, "clock_timestamp()", "'"+at.Format("2006-01-02 15:04:05.000000")+"+00'::timestamptz")
				case "mysql":
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
			}
		}
	}
}

// SQLite's now at consecutive milliseconds: julianday('now') is a float of
// days, and a plain cast of its product truncates a value that lands a
// hair under the millisecond (about one in two) to the millisecond
// before. A Done record's ttl then ends, for a Claim whose now is exact,
// up to a millisecond before completion time + ttl.
func TestSQLiteNowIsExactAtEveryMillisecond(t *testing.T) {
	db := sqliteEngine.open(t, sqliteEngine.dsn(t), nil)
	expr := dialect.SQLite().Now
	base := time.Date(2026, 11, 30, 14, 0, 0, 0, time.UTC)
	bad := 0
	for i := range 2000 {
		at := base.Add(time.Duration(i) * time.Millisecond)
		var got int64
		q := "SELECT " + strings.ReplaceAll(expr, "'now'", "'"+at.Format("2006-01-02 15:04:05.000")+"'")
		if err := db.QueryRow(q).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != at.UnixMilli() {
			bad++
			if bad <= 3 {
				t.Errorf("sqlite: now at %s = %d ms, want %d", at.Format(time.RFC3339Nano), got, at.UnixMilli())
			}
		}
	}
	if bad > 0 {
		t.Errorf("sqlite: now off at %d of 2000 milliseconds", bad)
	}
}
