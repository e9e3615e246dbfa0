package idempotency

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/retry"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// ErrDuplicate is returned by [Lock] when the key was already completed within
// its ttl: the body did not run. A message handler should ack it. The error
// is a *[DuplicateError], which names the key.
//
// The rule: decide to ack with IsOwnDuplicate(err, key); use
// errors.Is(err, ErrDuplicate) only to classify an error (a log line, a
// metric). errors.Is also holds for a body's error that wraps a nested
// Lock's duplicate: that body ran and failed, and Lock released the claim,
// so acking it would lose the message. [Idempotent] and [PushHandler] make
// that distinction themselves.
var ErrDuplicate = errors.New("idempotency: duplicate")

// DuplicateError is the error Lock returns for a key completed within its
// ttl. errors.Is(err, ErrDuplicate) reports true for it.
type DuplicateError struct {
	// Key is the completed key.
	Key string
	// Until is when duplicate suppression for the key ends; zero when the
	// backend does not say.
	Until time.Time

	// fromLock marks an error Lock made itself, which IsOwnDuplicate
	// requires: one a program builds is never taken for Lock's outcome.
	fromLock bool
}

// Error names the key and, when known, when suppression ends.
func (e *DuplicateError) Error() string {
	if e.Until.IsZero() {
		return fmt.Sprintf("idempotency: duplicate: key %q already completed", e.Key)
	}
	return fmt.Sprintf("idempotency: duplicate: key %q already completed (suppressed until %s)", e.Key, e.Until.UTC().Format(time.RFC3339Nano))
}

// Is reports whether target is ErrDuplicate.
func (e *DuplicateError) Is(target error) bool { return target == ErrDuplicate }

// IsOwnDuplicate reports whether err, returned by Lock(ctx, b, key, fn), is
// that call's own duplicate outcome (key was already done, fn did not run),
// as opposed to an error fn returned that wraps a nested Lock's duplicate
// on another key. Only the former may be acked: after the latter, Lock
// released key and the message must come back.
//
// Lock returns its own duplicate as is, never wrapped, so IsOwnDuplicate
// holds only for err itself being a *DuplicateError for key that a Lock
// call made: not for one wrapped in another error, nor for one a program
// built. The one case it cannot tell apart is a body that returns, as is,
// the duplicate of a nested Lock on the same key (on another backend).
func IsOwnDuplicate(err error, key string) bool {
	d, ok := err.(*DuplicateError)
	return ok && d != nil && d.fromLock && d.Key == key
}

// ErrInProgress is returned by [Lock] and [Mutex] when another holder's lease on
// the key is live (and by Mutex when the key was completed by Lock): the body
// did not run. A message handler should nack it so the message comes back
// later. The error is an *[InProgressError], which says until when.
var ErrInProgress = errors.New("idempotency: in progress")

// InProgressError is the error Lock and Mutex return for a key that someone
// else holds. errors.Is(err, ErrInProgress) reports true for it.
type InProgressError struct {
	// Key is the contended key.
	Key string
	// Until is when the holder's lease lapses (or, with Done, when the
	// completed record expires); zero when the backend does not say.
	Until time.Time
	// Done reports that the key is completed, not held: Mutex refuses to run
	// over a key that Lock completed.
	Done bool
}

// Error describes the contention and, when known, when it ends.
func (e *InProgressError) Error() string {
	what := "is held by another delivery"
	if e.Done {
		what = "was completed by Lock; Mutex will not run over it"
	}
	if e.Until.IsZero() {
		return fmt.Sprintf("idempotency: key %q %s", e.Key, what)
	}
	return fmt.Sprintf("idempotency: key %q %s until %s", e.Key, what, e.Until.UTC().Format(time.RFC3339Nano))
}

// Is reports whether target is ErrInProgress.
func (e *InProgressError) Is(target error) bool { return target == ErrInProgress }

type claimKey struct{}

// claimCtx is the body's context: its parent's values, deadline and
// cancellation, and the claim under the key ClaimFrom reads. One
// allocation where context.WithValue takes two.
type claimCtx struct {
	context.Context
	claim store.Claim
}

// Value returns the claim for ClaimFrom's key, else the parent's value.
func (c *claimCtx) Value(key any) any {
	if _, ok := key.(claimKey); ok {
		return c.claim
	}
	return c.Context.Value(key)
}

// String names the context as context.WithValue's does.
func (c *claimCtx) String() string {
	return fmt.Sprintf("%v.WithValue(idempotency.claimKey, %v)", c.Context, c.claim.Key)
}

// ClaimFrom returns the claim under which the current body runs. Lock and
// Mutex put it in the context they pass to the body. Its Fence rises with
// every new holder of the key, so a sink that remembers the highest fence
// it has seen per key can refuse writes from a holder that was replaced.
func ClaimFrom(ctx context.Context) (store.Claim, bool) {
	c, ok := ctx.Value(claimKey{}).(store.Claim)
	return c, ok
}

// Lock runs fn at most once per key: it claims key on b, runs fn, and marks
// the key done when fn returns nil.
//
//   - Key completed within its ttl: fn does not run; Lock returns a
//     *DuplicateError (errors.Is ErrDuplicate), or, when the call has a
//     payload fingerprint ([WithPayloadFingerprint]) and the key was
//     completed with a different one, a *PayloadMismatchError (errors.Is
//     ErrPayloadMismatch, not ErrDuplicate).
//   - Key held by a live lease elsewhere: fn does not run; Lock returns an
//     *InProgressError (errors.Is ErrInProgress).
//   - fn returns an error: the claim is released (the key can be claimed at
//     once) and Lock returns fn's error unchanged, even when it wraps
//     ErrDuplicate or ErrInProgress (a nested Lock's outcome): ack a
//     duplicate only when [IsOwnDuplicate](err, key) (the rule of
//     [ErrDuplicate]), not on errors.Is.
//   - fn panics: the claim is released and the panic continues.
//   - fn returns nil: Lock completes the key and returns nil. A failed
//     Complete is tried again until the settle timeout. If it still
//     fails, or the claim was fenced out because fn outran its lease and
//     another delivery took the key, Lock logs an error and still returns
//     nil: the work happened, and reporting failure would make the message
//     come back and the work run again.
//
// A claim error is returned wrapped. fn receives a context carrying the
// claim (see [ClaimFrom]): ctx itself, with its values, deadline and
// cancellation, plus, under [WithHeartbeat], a cancellation when the claim
// is lost. Lock does not wait for work that fn starts and leaves running,
// and without a heartbeat it does not cancel fn's context when fn returns:
// such work runs outside the claim (beside the next holder of the key), so
// wait for it before returning. Complete and Release run on a context that
// ignores ctx's cancellation, bounded by the settle timeout.
func Lock(ctx context.Context, b store.Backend, key string, fn func(context.Context) error, opts ...LockOption) error {
	cfg := newLockConfig(opts...)
	_, err := run(ctx, b, key, "", cfg.fingerprint, fn, nil, &cfg, false, nil)
	return err
}

// Mutex runs fn with key held, so that no two calls for the same key run
// at once anywhere, and then releases the key. Unlike [Lock] it never marks
// the key done: every call runs fn, one at a time.
//
//   - Key held elsewhere, or completed by Lock: fn does not run; Mutex
//     returns an *InProgressError (errors.Is ErrInProgress).
//   - fn returns: the claim is released and Mutex returns fn's error
//     unchanged (nil included). A Release that still fails after retries
//     for the settle timeout is logged, not returned: the lease lapses by
//     itself.
//   - fn panics: the claim is released and the panic continues.
//
// fn's context is as for [Lock]: work that fn leaves running when it
// returns is no longer excluded.
//
// Mutex excludes; it does not order. Calls that find the key busy must try
// again later, and may then run in any order.
func Mutex(ctx context.Context, b store.Backend, key string, fn func(context.Context) error, opts ...LockOption) error {
	cfg := newLockConfig(opts...)
	_, err := run(ctx, b, key, "", "", fn, nil, &cfg, true, nil)
	return err
}

// run is the engine of Lock, Mutex and Idempotent. ran reports whether fn
// was called: when it was, err is fn's own error (nil included), whatever
// it wraps; when it was not, err is run's own outcome (a *DuplicateError,
// a *PayloadMismatchError, an *InProgressError, or a failure to claim).
// The wrapper acks a duplicate only when ran is false. fp is the payload's
// fingerprint ("" for none): stored by the completion, and compared with
// the stored one when the key is done. found is the key as the wrapper's
// KeyFunc found it, before the prefix and any hashing ("" for Lock and
// Mutex): like key, it is kept out of the spans unless WithKeyInSpans.
//
// With tx set (and fn nil) the body runs inside the backend's transaction
// that also completes the claim (see LockTx).
//
// When spanCtx is not nil, run sets it to ctx with the call's span (or
// ctx itself, when it records none), for the caller's log lines about
// the delivery: they then name its trace and span.
func run(ctx context.Context, b store.Backend, key, found, fp string, fn func(context.Context) error, tx txFunc, cfg *lockConfig, mutex bool, spanCtx *context.Context) (ran bool, err error) {
	if b == nil {
		return false, errors.New("idempotency: nil backend")
	}
	if fn == nil && tx == nil {
		return false, errors.New("idempotency: nil body")
	}
	if err := cfg.validate(); err != nil {
		return false, fmt.Errorf(errPrefix+" %w", err)
	}
	if err := store.ValidateFingerprint(fp); err != nil {
		return false, fmt.Errorf(errPrefix+" key %q: %w", key, err)
	}
	lease, fromDeadline := cfg.leaseFor(ctx)
	var tr tracker // spans and metrics (telemetry.go)
	ctx = tr.begin(ctx, cfg, key, found, mutex)
	if spanCtx != nil {
		*spanCtx = ctx
	}
	defer tr.end(ctx, &err)
	res, err := b.Claim(tr.claim(ctx), key, lease)
	tr.claimed(ctx, res, err)
	if err != nil {
		return false, fmt.Errorf("idempotency: claim %q: %w", key, err)
	}
	switch res.Outcome {
	case store.Won:
	case store.AlreadyDone:
		if mutex {
			return false, &InProgressError{Key: key, Until: res.Until, Done: true}
		}
		if mismatch(res.Fingerprint, fp) {
			return false, &PayloadMismatchError{Key: key, Stored: res.Fingerprint, Delivered: fp, Until: res.Until}
		}
		return false, &DuplicateError{Key: key, Until: res.Until, fromLock: true}
	case store.HeldByOther:
		return false, &InProgressError{Key: key, Until: res.Until}
	default:
		return false, fmt.Errorf("idempotency: claim %q: backend returned unknown outcome %v", key, res.Outcome)
	}
	c := res.Claim
	log := cfg.log()
	if fromDeadline {
		// This delivery's lease, which renewals extend by, and a heartbeat
		// that ticks at least three times within it.
		d := *cfg
		d.lease = lease
		if d.heartbeat > lease/3 {
			d.heartbeat = max(lease/3, time.Millisecond)
		}
		cfg = &d
	} else if dl, ok := ctx.Deadline(); ok && dl.After(c.LeaseExpiry) && cfg.heartbeat == 0 {
		log.WarnContext(ctx, "idempotency: the request may outlive its lease; raise the lease above the request timeout, or use WithHeartbeat",
			"key", key, "lease", cfg.lease, "deadline_in", time.Until(dl).Round(time.Second))
	}

	// Without a heartbeat the body runs on ctx itself: nothing but ctx
	// can cancel it, so a context of its own would only cost allocations.
	bodyCtx, stopHeartbeat := ctx, func() {}
	if cfg.heartbeat > 0 {
		var cancelBody context.CancelCauseFunc
		bodyCtx, cancelBody = context.WithCancelCause(ctx)
		defer cancelBody(nil)
		// hc, not c, is shared with the renewing goroutine, so that c
		// stays off the heap when there is no heartbeat.
		hc := c
		stop := heartbeat(bodyCtx, b, &hc, cfg, cancelBody)
		stopHeartbeat = func() { stop(); c = hc }
	}
	settled := false
	defer func() {
		if settled {
			return
		}
		// fn panicked or called runtime.Goexit: give the key back at once.
		stopHeartbeat()
		tr.bodyEnded(errBodyPanicked)
		err := settle(tr.settling(ctx, opRelease), cfg, func(ctx context.Context) error { return retryUntilDone(ctx, func() error { return b.Release(ctx, c) }) })
		tr.settled(ctx, true, err)
		if err != nil {
			log.ErrorContext(ctx, "idempotency: release after a panic failed; the key frees when its lease lapses",
				"key", key, "fence", c.Fence, "lease_expiry", c.LeaseExpiry, "error", err)
		}
	}()
	if tx != nil {
		return true, runTx(ctx, bodyCtx, b, c, fp, tx, cfg, &tr, stopHeartbeat, &settled)
	}
	ferr := fn(tr.body(&claimCtx{Context: bodyCtx, claim: c}))
	stopHeartbeat() // from here on c is the latest renewal's claim
	settled = true
	tr.bodyEnded(ferr)

	if ferr != nil || mutex {
		err := settle(tr.settling(ctx, opRelease), cfg, func(ctx context.Context) error { return retryUntilDone(ctx, func() error { return b.Release(ctx, c) }) })
		tr.settled(ctx, true, err)
		if err != nil {
			log.WarnContext(ctx, "idempotency: release failed; the key frees when its lease lapses",
				"key", key, "fence", c.Fence, "lease_expiry", c.LeaseExpiry, "error", err)
		}
		return true, ferr
	}

	// Complete is safe to retry, and a key left Claimed after the work ran
	// would be reclaimed when its lease lapses (a republish, or a second
	// subscription's copy, would then run the work again): a failure is
	// tried again until the settle timeout.
	var done bool
	err = settle(tr.settling(ctx, opComplete), cfg, func(ctx context.Context) error {
		return retryUntilDone(ctx, func() (err error) {
			done, err = complete(ctx, b, c, fp)
			return err
		})
	})
	tr.settled(ctx, done, err)
	switch {
	case err != nil:
		log.ErrorContext(ctx, "idempotency: the work ran but marking the key done failed; acknowledging anyway, a redelivery after the lease may repeat the work",
			"key", key, "fence", c.Fence, "lease_expiry", c.LeaseExpiry, "error", err)
	case !done:
		log.ErrorContext(ctx, "idempotency: the work ran but the claim was fenced out (the work outran its lease and another delivery took the key, which may repeat the work); acknowledging anyway; raise the lease",
			"key", key, "fence", c.Fence, "lease", cfg.lease, "lease_expiry", c.LeaseExpiry)
	}
	return true, nil
}

// complete completes c, storing fp with it when fp is not empty and b
// keeps fingerprints.
func complete(ctx context.Context, b store.Backend, c store.Claim, fp string) (bool, error) {
	if f, ok := b.(store.Fingerprinter); ok && fp != "" {
		return f.CompleteFingerprint(ctx, c, fp)
	}
	return b.Complete(ctx, c)
}

// leaseFor returns the lease to claim with on ctx, and whether it was
// sized from ctx's deadline (see WithLeaseFromDeadline): the time left
// until the deadline (none when it has passed) + the settle timeout +
// the margin, saturating rather than overflowing for a far deadline.
func (c *lockConfig) leaseFor(ctx context.Context) (time.Duration, bool) {
	if !c.fromDeadline {
		return c.lease, false
	}
	dl, ok := ctx.Deadline()
	if !ok {
		return c.lease, false
	}
	now := time.Now
	if c.now != nil {
		now = c.now
	}
	return addSat(addSat(max(dl.Sub(now()), 0), c.settle), c.margin), true
}

// addSat returns a + b for b >= 0, or the longest duration when the sum
// overflows.
func addSat(a, b time.Duration) time.Duration {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// heartbeat renews *c every cfg.heartbeat until the returned stop is
// called (stop waits for the renewing goroutine, after which *c holds the
// latest claim). A lost claim cancels the body through cancel.
func heartbeat(ctx context.Context, b store.Backend, c *store.Claim, cfg *lockConfig, cancel context.CancelCauseFunc) (stop func()) {
	if cfg.heartbeat <= 0 {
		return func() {}
	}
	ext, ok := b.(store.Extender)
	if !ok {
		cfg.log().WarnContext(ctx, "idempotency: WithHeartbeat ignored: the backend cannot renew leases (no store.Extender)",
			"backend", fmt.Sprintf("%T", b))
		return func() {}
	}
	var (
		mu   sync.Mutex
		cur  = *c
		done = make(chan struct{})
		wg   sync.WaitGroup
	)
	// Renewals outlive the request's cancellation: only the body's return
	// (done) ends them, because the body may still be running the work.
	ctx = context.WithoutCancel(ctx)
	wg.Go(func() {
		t := time.NewTicker(cfg.heartbeat)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			mu.Lock()
			claim := cur
			mu.Unlock()
			ectx, ecancel := context.WithTimeout(ctx, cfg.settle)
			next, err := ext.Extend(ectx, claim, cfg.lease)
			ecancel()
			switch {
			case err == nil:
				mu.Lock()
				cur = next
				mu.Unlock()
			case errors.Is(err, store.ErrLost):
				select {
				case <-done:
					// The body returned while the renewal ran: a
					// transactional body's commit marked the key done,
					// which a renewal finds "lost". Nothing was.
					return
				default:
				}
				cfg.log().ErrorContext(ctx, "idempotency: the claim was lost while the work ran (another delivery took the key); cancelling the work",
					"key", claim.Key, "fence", claim.Fence, "error", err)
				cancel(fmt.Errorf("idempotency: lease renewal: %w", err))
				return
			default:
				cfg.log().WarnContext(ctx, "idempotency: lease renewal failed; trying again at the next heartbeat",
					"key", claim.Key, "fence", claim.Fence, "lease_expiry", claim.LeaseExpiry, "error", err)
			}
		}
	})
	var once sync.Once
	return func() {
		once.Do(func() {
			close(done)
			wg.Wait() // an in-flight renewal finishes: its claim is the latest
			mu.Lock()
			*c = cur
			mu.Unlock()
		})
	}
}

// settleRetry retries a failed Complete or Release until the settle
// timeout ends: both are safe to repeat.
var settleRetry = retry.Policy{Retries: math.MaxInt, Base: 20 * time.Millisecond, Max: time.Second}

// retryUntilDone calls op until it returns nil or ctx ends; see
// retry.Policy.Do for the error it returns then.
func retryUntilDone(ctx context.Context, op func() error) error {
	return settleRetry.Do(ctx, func(int) error { return op() }, func(error) bool { return true })
}

// settle runs op on a context that keeps ctx's values but not its
// cancellation, bounded by the settle timeout.
func settle(ctx context.Context, cfg *lockConfig, op func(context.Context) error) error {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.settle)
	defer cancel()
	return op(sctx)
}
