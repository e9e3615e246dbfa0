// Package retry is the one backoff loop the backends share: it calls an
// operation again after a failure the caller calls transient, waits a
// jittered, exponentially growing delay between attempts, and gives up
// when the retries are spent or the context ends.
//
// It knows nothing of what a retry means for the record: whether an
// attempt whose reply was lost may be resent is the backend's judgement,
// made in the retryable func it passes (or in its own loop around Wait).
package retry

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"
)

// Policy says how many times an operation is retried and how long the
// waits between attempts are. The zero Policy never retries.
type Policy struct {
	// Retries is how many attempts may follow the first. Negative means 0.
	Retries int
	// Base is the wait after the first failed attempt, before jitter; each
	// later wait doubles it. Zero means 10ms.
	Base time.Duration
	// Max caps a wait before jitter. Zero means 1s.
	Max time.Duration

	// after replaces time.After in tests (see export_test.go).
	after func(time.Duration) <-chan time.Time
}

// Delay is the wait after failed attempt number attempt (0 is the first
// attempt): Base doubled attempt times, capped at Max, then jittered into
// [d/2, d] so that callers who failed together do not retry together.
func (p Policy) Delay(attempt int) time.Duration {
	base, limit := p.Base, p.Max
	if base <= 0 {
		base = 10 * time.Millisecond
	}
	if limit <= 0 {
		limit = time.Second
	}
	d := base
	for i := 0; i < attempt && d < limit; i++ {
		d *= 2
	}
	d = min(d, limit)
	half := d / 2
	return half + rand.N(d-half+1)
}

// Wait blocks for Delay(attempt), or until ctx ends, and then returns
// ctx.Err(): nil when the whole delay passed with ctx still live (a delay
// that ends as ctx ends returns ctx's error, so that no attempt follows).
func (p Policy) Wait(ctx context.Context, attempt int) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	after := p.after
	if after == nil {
		after = time.After
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-after(p.Delay(attempt)):
		// select picks at random when ctx ended at the same time.
		return ctx.Err()
	}
}

// Do calls op, numbering its attempts from 0, until op returns nil, or an
// error for which retryable returns false, or Retries attempts have
// followed the first, or ctx ends. It returns op's last error (nil on
// success). When ctx ends before op succeeds (before the first attempt,
// during an attempt that then failed, or during a wait) the error wraps
// ctx.Err() and, if an attempt had failed, that attempt's error too, so
// that errors.Is finds both. Do never calls op after ctx has ended.
func (p Policy) Do(ctx context.Context, op func(attempt int) error, retryable func(error) bool) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	for attempt := 0; ; attempt++ {
		err := op(attempt)
		if err == nil {
			return nil
		}
		if cerr := ctx.Err(); cerr != nil {
			return withCtx(cerr, err)
		}
		if attempt >= p.Retries || !retryable(err) {
			return err
		}
		if cerr := p.Wait(ctx, attempt); cerr != nil {
			return withCtx(cerr, err)
		}
	}
}

// withCtx wraps the context's error and the last attempt's, unless the
// attempt's error already is the context's.
func withCtx(cerr, err error) error {
	if errors.Is(err, cerr) {
		return err
	}
	return fmt.Errorf("%w: %w", cerr, err)
}
