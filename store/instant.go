package store

import "time"

// Time arithmetic for backends. Every instant a backend stores (a lease
// expiry, an expires-at) and every duration it sends in a store's own unit
// goes through these two functions, so a duration near math.MaxInt64 can
// never wrap into the past: the port saturates, it does not refuse. Any
// positive lease or ttl is honoured, and one of math.MaxInt64 (about 292
// years) lasts, in effect, for ever.

// MaxInstant is the latest instant a backend stores:
// 9999-12-31T23:59:59.999999Z, the end of the range of the Datastore,
// Firestore and Spanner timestamp types and of MySQL's DATETIME. [Instant]
// never returns a later one.
var MaxInstant = time.Date(9999, time.December, 31, 23, 59, 59, 999999000, time.UTC)

// Instant returns base plus each of ds, rounded up to a whole unit (a
// whole number of units since the Unix epoch; unit 0 or less means no
// rounding), capped at MaxInstant. It never overflows: for durations that
// are not negative the result is never before base, whatever their size.
// Backends use it for every lease expiry and expires-at instant they
// compute on the client.
func Instant(base time.Time, unit time.Duration, ds ...time.Duration) time.Time {
	t := base
	for _, d := range ds {
		// time.Time spans hundreds of billions of years: adding
		// durations of up to 292 years each cannot wrap it.
		t = t.Add(d)
		if t.After(MaxInstant) {
			return MaxInstant
		}
	}
	if unit > 0 {
		if r := t.Sub(t.Truncate(unit)); r != 0 {
			// Truncate rounds towards the zero Time, not the epoch;
			// for units that divide a second (every unit a store uses)
			// both agree.
			t = t.Add(unit - r)
		}
	}
	if t.After(MaxInstant) {
		return MaxInstant
	}
	return t
}

// CeilUnits returns d in whole units of unit, rounded up, without
// overflow: CeilUnits(math.MaxInt64, time.Millisecond) is 9223372036855,
// where the usual (d + unit - 1) / unit wraps to a negative number. A d of
// zero or less gives 0 or less (d / unit, rounded towards zero). Backends
// use it to send a lease or ttl to a store that computes instants itself
// (Redis, SQL, Spanner).
func CeilUnits(d, unit time.Duration) int64 {
	n := int64(d / unit)
	if d > 0 && d%unit != 0 {
		n++
	}
	return n
}
