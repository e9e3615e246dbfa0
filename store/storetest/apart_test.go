package storetest

import (
	"testing"
	"time"
)

// cutMidCall's checks that two completions of a key (or two wins of one
// fence) lie a ttl apart hold whichever of the two calls was recorded
// first: a goroutine may record its call after another goroutine recorded
// a later one. The check it replaces compared the call recorded second
// with the start of the one recorded first only, and so failed a correct
// backend ("fences ... both completed within the ttl") when the one that
// took effect later was recorded first.
func TestApartHoldsInEitherOrderOfRecording(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(from, to time.Duration) window { return window{t0.Add(from), t0.Add(to)} }
	const ttl = 2 * time.Second
	for _, tc := range []struct {
		a, b window
		want bool
	}{
		{at(0, 100*time.Millisecond), at(2100*time.Millisecond, 2200*time.Millisecond), true}, // b a ttl after a
		{at(0, 100*time.Millisecond), at(1500*time.Millisecond, 2050*time.Millisecond), true}, // b may have taken effect at 2s
		{at(0, 100*time.Millisecond), at(1500*time.Millisecond, 1900*time.Millisecond), false},
		{at(0, 3*time.Second), at(500*time.Millisecond, 600*time.Millisecond), true}, // a may have taken effect 2.5s in
		{at(0, 1*time.Second), at(500*time.Millisecond, 600*time.Millisecond), false},
	} {
		if got := apart(tc.a, tc.b, ttl); got != tc.want {
			t.Errorf("apart(%v, %v) = %v, want %v", tc.a, tc.b, got, tc.want)
		}
		if got := apart(tc.b, tc.a, ttl); got != tc.want {
			t.Errorf("apart(%v, %v) (the other order) = %v, want %v", tc.b, tc.a, got, tc.want)
		}
	}
}
