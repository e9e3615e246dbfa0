package retry_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/retry"
)

var errTransient = errors.New("transient")

func always(error) bool { return true }

// instant is an injected clock: every wait ends at once, and the waits
// asked for are recorded.
type instant struct{ waits []time.Duration }

func (c *instant) after(d time.Duration) <-chan time.Time {
	c.waits = append(c.waits, d)
	ch := make(chan time.Time, 1)
	ch <- time.Time{}
	return ch
}

func TestDelayDoublesFromBaseUpToMaxWithJitterInTheUpperHalf(t *testing.T) {
	p := retry.Policy{Base: 10 * time.Millisecond, Max: 100 * time.Millisecond}
	want := []time.Duration{10, 20, 40, 80, 100, 100, 100}
	for attempt, w := range want {
		w *= time.Millisecond
		for range 200 {
			d := p.Delay(attempt)
			if d < w/2 || d > w {
				t.Fatalf("Delay(%d) = %v, want within [%v, %v]", attempt, d, w/2, w)
			}
		}
	}
	if d := p.Delay(1 << 20); d > p.Max {
		t.Fatalf("Delay of a huge attempt = %v, over Max %v", d, p.Max)
	}
}

func TestDelayIsJittered(t *testing.T) {
	p := retry.Policy{Base: time.Second}
	seen := map[time.Duration]bool{}
	for range 50 {
		seen[p.Delay(0)] = true
	}
	if len(seen) < 2 {
		t.Fatalf("50 delays took %d distinct values: no jitter", len(seen))
	}
}

func TestZeroPolicyDefaults(t *testing.T) {
	var p retry.Policy
	if d := p.Delay(0); d < 5*time.Millisecond || d > 10*time.Millisecond {
		t.Fatalf("zero Policy's first delay %v, want within [5ms, 10ms]", d)
	}
	if d := p.Delay(30); d < 500*time.Millisecond || d > time.Second {
		t.Fatalf("zero Policy's capped delay %v, want within [500ms, 1s]", d)
	}
	calls := 0
	err := p.Do(context.Background(), func(int) error { calls++; return errTransient }, always)
	if calls != 1 || !errors.Is(err, errTransient) {
		t.Fatalf("zero Policy: %d calls, err %v; want 1 call and the op's error", calls, err)
	}
}

func TestDoRetriesATransientErrorUpToRetriesTimes(t *testing.T) {
	c := &instant{}
	p := retry.WithAfter(retry.Policy{Retries: 3}, c.after)
	var attempts []int
	err := p.Do(context.Background(), func(a int) error { attempts = append(attempts, a); return errTransient }, always)
	if !errors.Is(err, errTransient) {
		t.Fatalf("err %v, want the op's last error", err)
	}
	if len(attempts) != 4 || attempts[0] != 0 || attempts[3] != 3 {
		t.Fatalf("attempts %v, want [0 1 2 3]", attempts)
	}
	if len(c.waits) != 3 {
		t.Fatalf("%d waits, want 3 (one between each two attempts)", len(c.waits))
	}
}

func TestDoStopsAtTheFirstSuccess(t *testing.T) {
	c := &instant{}
	p := retry.WithAfter(retry.Policy{Retries: 5}, c.after)
	calls := 0
	err := p.Do(context.Background(), func(a int) error {
		calls++
		if a < 2 {
			return errTransient
		}
		return nil
	}, always)
	if err != nil || calls != 3 {
		t.Fatalf("err %v after %d calls, want nil after 3", err, calls)
	}
}

func TestDoDoesNotRetryWhatRetryableRefuses(t *testing.T) {
	c := &instant{}
	p := retry.WithAfter(retry.Policy{Retries: 5}, c.after)
	final := errors.New("final")
	calls := 0
	err := p.Do(context.Background(), func(int) error { calls++; return final }, func(err error) bool { return !errors.Is(err, final) })
	if calls != 1 || err != final || len(c.waits) != 0 {
		t.Fatalf("%d calls, %d waits, err %v; want 1 call, no wait, the op's error", calls, len(c.waits), err)
	}
}

func TestDoNeverCallsOpAfterCtxEnded(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	calls := 0
	err := retry.Policy{Retries: 3}.Do(ctx, func(int) error { calls++; return nil }, always)
	if calls != 0 || !errors.Is(err, context.Canceled) {
		t.Fatalf("%d calls, err %v; want no call and context.Canceled", calls, err)
	}
}

func TestDoWrapsCtxAndTheAttemptsErrorWhenCtxEndsDuringAWait(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	never := func(time.Duration) <-chan time.Time { cancel(); return nil }
	p := retry.WithAfter(retry.Policy{Retries: 3}, never)
	calls := 0
	err := p.Do(ctx, func(int) error { calls++; return errTransient }, always)
	if calls != 1 || !errors.Is(err, context.Canceled) || !errors.Is(err, errTransient) {
		t.Fatalf("%d calls, err %v; want 1 call and an error wrapping both context.Canceled and the op's error", calls, err)
	}
}

func TestDoWrapsCtxWhenAnAttemptFailsBecauseCtxEnded(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	p := retry.Policy{Retries: 3}
	broken := errors.New("connection reset")
	err := p.Do(ctx, func(int) error { cancel(); return broken }, always)
	if !errors.Is(err, context.Canceled) || !errors.Is(err, broken) {
		t.Fatalf("err %v, want one wrapping context.Canceled and the attempt's error", err)
	}
	err = p.Do(context.Background(), func(int) error { return nil }, always)
	if err != nil {
		t.Fatal(err)
	}
}

func TestDoDoesNotDoubleWrapTheCtxError(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	err := retry.Policy{Retries: 3}.Do(ctx, func(int) error { cancel(); return ctx.Err() }, always)
	if err != context.Canceled {
		t.Fatalf("err %v, want context.Canceled itself", err)
	}
}

func TestWaitReturnsCtxErrWhenCtxEndsFirst(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := (retry.Policy{Base: time.Hour}).Wait(ctx, 0); !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait on an ended ctx = %v, want context.Canceled", err)
	}
	c := &instant{}
	if err := retry.WithAfter(retry.Policy{}, c.after).Wait(context.Background(), 0); err != nil || len(c.waits) != 1 {
		t.Fatalf("Wait = %v after %d waits, want nil after 1", err, len(c.waits))
	}
}

// A wait whose timer fires as ctx ends (both ready at once) must not let
// Do call op again: select picks either case at random, and Do promises
// never to call op after ctx has ended.
func TestDoNeverCallsOpWhenCtxEndsAsTheWaitEnds(t *testing.T) {
	for i := range 200 {
		ctx, cancel := context.WithCancel(context.Background())
		both := func(time.Duration) <-chan time.Time {
			cancel()
			ch := make(chan time.Time, 1)
			ch <- time.Time{}
			return ch
		}
		p := retry.WithAfter(retry.Policy{Retries: 3}, both)
		calls := 0
		err := p.Do(ctx, func(int) error { calls++; return errTransient }, always)
		if calls != 1 || !errors.Is(err, context.Canceled) || !errors.Is(err, errTransient) {
			t.Fatalf("run %d: %d calls, err %v; want 1 call and an error wrapping context.Canceled and the op's error", i, calls, err)
		}
		if err := p.Wait(ctx, 0); !errors.Is(err, context.Canceled) {
			t.Fatalf("run %d: Wait with ctx ended as the delay passed = %v, want context.Canceled", i, err)
		}
	}
}
