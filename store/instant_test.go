package store_test

import (
	"math"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A duration at its limit never wraps an instant into the past: the rule
// that six backends broke when each rounded durations by itself.
func TestInstantNeverWrapsIntoThePast(t *testing.T) {
	base := time.Date(2026, 12, 1, 10, 0, 0, 123456789, time.UTC)
	centuries := 250 * 365 * 24 * time.Hour // two and a half centuries
	for _, d := range []time.Duration{
		1, time.Microsecond - 1, time.Microsecond, time.Hour, centuries,
		math.MaxInt64 - 500, math.MaxInt64 - 1, math.MaxInt64,
	} {
		for _, unit := range []time.Duration{0, time.Microsecond, time.Millisecond} {
			got := store.Instant(base, unit, d)
			if got.Before(base.Add(d)) {
				t.Errorf("Instant(base, %v, %v) = %v, before base + d = %v", unit, d, got, base.Add(d))
			}
			if unit > 0 && got.Sub(base.Add(d)) >= unit {
				t.Errorf("Instant(base, %v, %v) = %v, a whole unit or more past base + d = %v", unit, d, got, base.Add(d))
			}
			if unit > 0 && got.Nanosecond()%int(unit) != 0 {
				t.Errorf("Instant(base, %v, %v) = %v is not a whole %v", unit, d, got, unit)
			}
		}
	}
	// Two durations at their limit (a lease and a ttl) add up without
	// wrapping either.
	if got, want := store.Instant(base, time.Microsecond, math.MaxInt64, math.MaxInt64), base.Add(math.MaxInt64).Add(math.MaxInt64); got.Before(want) {
		t.Errorf("Instant(base, µs, max, max) = %v, want at least %v", got, want)
	}
}

func TestInstantIsCappedAtMaxInstant(t *testing.T) {
	late := time.Date(9999, 12, 31, 23, 0, 0, 0, time.UTC)
	if got := store.Instant(late, time.Microsecond, time.Hour, math.MaxInt64); !got.Equal(store.MaxInstant) {
		t.Errorf("Instant(9999-12-31T23:00, 1h + max) = %v, want MaxInstant %v", got, store.MaxInstant)
	}
	if got := store.Instant(store.MaxInstant, time.Millisecond); !got.Equal(store.MaxInstant) {
		t.Errorf("Instant(MaxInstant) rounded to ms = %v, want MaxInstant", got)
	}
	if got := store.Instant(store.MaxInstant.Add(time.Hour), 0); !got.Equal(store.MaxInstant) {
		t.Errorf("Instant(after MaxInstant) = %v, want MaxInstant", got)
	}
}

func TestCeilUnits(t *testing.T) {
	for _, c := range []struct {
		d, unit time.Duration
		want    int64
	}{
		{0, time.Millisecond, 0},
		{1, time.Millisecond, 1},
		{time.Millisecond, time.Millisecond, 1},
		{time.Millisecond + 1, time.Millisecond, 2},
		{math.MaxInt64, time.Millisecond, 9223372036855},
		{math.MaxInt64 - 807, time.Microsecond, 9223372036854775},
		{math.MaxInt64, time.Microsecond, 9223372036854776},
		{math.MaxInt64, 1, math.MaxInt64},
		{-time.Millisecond - 1, time.Millisecond, -1},
	} {
		if got := store.CeilUnits(c.d, c.unit); got != c.want {
			t.Errorf("CeilUnits(%d, %v) = %d, want %d", c.d, c.unit, got, c.want)
		}
	}
}
