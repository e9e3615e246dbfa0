package idempotency

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/retry"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// ErrDuplicate is returned by [Lock] when the key was already completed within
// its ttl: the body did not run. A message handler should ack it. The error
// is a *[DuplicateError], which names the key.
//
// errors.Is(err, ErrDuplicate) also holds for a body's error that wraps a
// nested Lock's duplicate: that body ran and failed, and Lock released the
// claim, so acking it would lose the message. Ack only Lock's own outcome:
// see [IsOwnDuplicate]. [Idempotent] and [PushHandler] make that
// distinction themselves.
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
	// Superseded reports, from [LockTx], that the body ran but this
	// delivery's claim was superseded before its transaction committed
	// (its lease lapsed and another delivery claimed the key, or the
	// claim was released): nothing was committed. Whether the other
	// delivery still holds the key or has finished is not known.
	Superseded bool
}

// Error describes the contention and, when known, when it ends.
func (e *InProgressError) Error() string {
	if e.Superseded {
		return fmt.Sprintf("idempotency: key %q: this delivery's claim was superseded before its transaction committed (its lease lapsed and another delivery claimed the key, or the claim was released); nothing was committed", e.Key)
	}
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
//     ErrDuplicate or ErrInProgress (a nested Lock's outcome): test with
//     [IsOwnDuplicate], not errors.Is, before acking a duplicate.
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
	return delivery{b: b, key: key, fp: cfg.fingerprint, cfg: &cfg}.run(ctx, body{fn: fn}).err
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
	return delivery{b: b, key: key, cfg: &cfg, mutex: true}.run(ctx, body{fn: fn}).err
}

// delivery is one guarded run of a body under a key: the one path from
// a resolved key to an outcome, which Lock, Mutex, LockTx and every
// transport (the CloudEvent wrapper, the push handler) share. A transport
// resolves the key and the fingerprint, runs the delivery, and
// translates its outcome into its own shapes; it adds no mode here.
type delivery struct {
	b store.Backend
	// key is the key as stored; found is the key as the wrapper's KeyFunc
	// found it, before the prefix and any hashing ("" for Lock and
	// Mutex). Like key, it is kept out of the spans unless
	// WithKeyInSpans.
	key, found string
	// fp is the payload's fingerprint ("" for none): stored by the
	// completion, and compared with the stored one when the key is done.
	fp    string
	cfg   *lockConfig
	mutex bool // Mutex: release after the body, never complete
}

// body is what a delivery runs under its claim: fn, or, for LockTx, tx,
// which runs the body inside the backend's transaction that also
// completes the claim. It is kept apart from the delivery, whose backend
// escapes to the heap (the heartbeat's goroutine holds it), so that a
// transport's closure does not go with it.
type body struct {
	fn func(context.Context) error
	tx txFunc
}

// outcome is what a delivery came to. When ran is set the body was
// called, and err is the body's own error (nil included), whatever it
// wraps, or, under LockTx, what became of its transaction; otherwise
// err is the guard's own outcome (a *DuplicateError, a
// *PayloadMismatchError, an *InProgressError, or a failure to claim), and
// only then may a transport ack a duplicate. ctx is the caller's context
// with the delivery's span (ctx itself when none is recorded), for the
// transport's log lines about the delivery: they then name its trace and
// span.
type outcome struct {
	ran bool
	err error
	ctx context.Context
}

// run runs the delivery of body on ctx.
func (d delivery) run(ctx context.Context, body body) (o outcome) {
	o.ctx = ctx
	if d.b == nil {
		o.err = errors.New("idempotency: nil backend")
		return o
	}
	if body.fn == nil && body.tx == nil {
		o.err = errors.New("idempotency: nil body")
		return o
	}
	if err := d.cfg.validate(); err != nil {
		o.err = fmt.Errorf(errPrefix+" %w", err)
		return o
	}
	if err := store.ValidateFingerprint(d.fp); err != nil {
		o.err = fmt.Errorf(errPrefix+" key %q: %w", d.key, err)
		return o
	}
	lease, fromDeadline := d.cfg.leaseFor(ctx)
	var tr tracker // spans and metrics (telemetry.go)
	ctx = tr.begin(ctx, d.cfg, d.key, d.found, d.mutex)
	o.ctx = ctx
	defer tr.end(ctx, &o.err)
	c, err := d.claim(ctx, &tr, lease)
	if err != nil {
		o.err = err
		return o
	}
	if fromDeadline {
		// This delivery's lease, which renewals extend by, and a heartbeat
		// that ticks at least three times within it.
		cfg := *d.cfg
		cfg.lease = lease
		if cfg.heartbeat > lease/3 {
			cfg.heartbeat = max(lease/3, time.Millisecond)
		}
		d.cfg = &cfg
	} else if dl, ok := ctx.Deadline(); ok && dl.After(c.LeaseExpiry) && d.cfg.heartbeat == 0 {
		d.cfg.log().WarnContext(ctx, "idempotency: the request may outlive its lease; raise the lease above the request timeout, or use WithHeartbeat",
			"key", d.key, "lease", d.cfg.lease, "deadline_in", time.Until(dl).Round(time.Second))
	}
	o.ran = true
	o.err = d.hold(ctx, &tr, c, body)
	return o
}

// claim claims the delivery's key for lease, and returns the won claim,
// or the guard's outcome as an error when the key is done or held
// elsewhere, or the failure to claim.
func (d *delivery) claim(ctx context.Context, tr *tracker, lease time.Duration) (store.Claim, error) {
	res, err := d.b.Claim(tr.claim(ctx), d.key, lease)
	tr.claimed(ctx, res, err)
	if err != nil {
		return store.Claim{}, fmt.Errorf("idempotency: claim %q: %w", d.key, err)
	}
	switch res.Outcome {
	case store.Won:
		return res.Claim, nil
	case store.AlreadyDone:
		if d.mutex {
			return store.Claim{}, &InProgressError{Key: d.key, Until: res.Until, Done: true}
		}
		if mismatch(res.Fingerprint, d.fp) {
			return store.Claim{}, &PayloadMismatchError{Key: d.key, Stored: res.Fingerprint, Delivered: d.fp, Until: res.Until}
		}
		return store.Claim{}, &DuplicateError{Key: d.key, Until: res.Until, fromLock: true}
	case store.HeldByOther:
		return store.Claim{}, &InProgressError{Key: d.key, Until: res.Until}
	}
	return store.Claim{}, fmt.Errorf("idempotency: claim %q: backend returned unknown outcome %v", d.key, res.Outcome)
}

// hold runs the body under the won claim c, with its heartbeat, and
// settles the claim: completes it after a body that returned nil (or, for
// LockTx, in the body's transaction), releases it otherwise, and after a
// panic, which then goes on.
func (d *delivery) hold(ctx context.Context, tr *tracker, c store.Claim, body body) error {
	cfg, log := d.cfg, d.cfg.log()
	// Without a heartbeat the body runs on ctx itself: nothing but ctx
	// can cancel it, so a context of its own would only cost allocations.
	bodyCtx, stopHeartbeat := ctx, func() {}
	var hb *beat // what the heartbeat learned; nil without one
	if cfg.heartbeat > 0 {
		var cancelBody context.CancelCauseFunc
		bodyCtx, cancelBody = context.WithCancelCause(ctx)
		defer cancelBody(nil)
		hb = &beat{cancel: cancelBody, tx: body.tx != nil}
		// hc, not c, is shared with the renewing goroutine, so that c
		// stays off the heap when there is no heartbeat.
		hc := c
		stop := heartbeat(bodyCtx, d.b, &hc, cfg, hb.lose)
		stopHeartbeat = func() { stop(); c = hc }
	}
	settled := false
	defer func() {
		if settled {
			return
		}
		// The body panicked or called runtime.Goexit: give the key back
		// at once.
		stopHeartbeat()
		tr.bodyEnded(errBodyPanicked)
		err := d.release(tr.settling(ctx, opRelease), c)
		tr.settled(ctx, true, err)
		if err != nil {
			log.ErrorContext(ctx, "idempotency: release after a panic failed; the key frees when its lease lapses",
				"key", d.key, "fence", c.Fence, "lease_expiry", c.LeaseExpiry, "error", err)
		}
	}()
	if body.tx != nil {
		won := c // the body's claim; c, shared with the deferred release, stays off the heap
		r := body.tx(tr.body(bodyCtx), won, d.fp, func(tctx context.Context) context.Context {
			hb.enter()
			return &claimCtx{Context: tctx, claim: won}
		}, hb.leave)
		settled = true
		stopHeartbeat()
		tr.bodyEnded(r.bodyErr)
		return d.settleTx(ctx, tr, c, hb.cutBody(), r)
	}
	ferr := body.fn(tr.body(&claimCtx{Context: bodyCtx, claim: c}))
	stopHeartbeat() // from here on c is the latest renewal's claim
	settled = true
	tr.bodyEnded(ferr)

	if ferr != nil || d.mutex {
		err := d.release(tr.settling(ctx, opRelease), c)
		tr.settled(ctx, true, err)
		if err != nil {
			log.WarnContext(ctx, "idempotency: release failed; the key frees when its lease lapses",
				"key", d.key, "fence", c.Fence, "lease_expiry", c.LeaseExpiry, "error", err)
		}
		return ferr
	}

	// Complete is safe to retry, and a key left Claimed after the work ran
	// would be reclaimed when its lease lapses (a republish, or a second
	// subscription's copy, would then run the work again): a failure is
	// tried again until the settle timeout.
	var done bool
	err := settle(tr.settling(ctx, opComplete), cfg, func(ctx context.Context) error {
		return retryUntilDone(ctx, func() (err error) {
			done, err = complete(ctx, d.b, c, d.fp)
			return err
		})
	})
	tr.settled(ctx, done, err)
	switch {
	case err != nil:
		log.ErrorContext(ctx, "idempotency: the work ran but marking the key done failed; acknowledging anyway, a redelivery after the lease may repeat the work",
			"key", d.key, "fence", c.Fence, "lease_expiry", c.LeaseExpiry, "error", err)
	case !done:
		log.ErrorContext(ctx, "idempotency: the work ran but the claim was fenced out (its lease lapsed and another delivery took the key, which may repeat the work, or an operator released it); acknowledging anyway; unless it was released by hand, raise the lease or use WithHeartbeat",
			"key", d.key, "fence", c.Fence, "lease", cfg.lease, "lease_expiry", c.LeaseExpiry)
	}
	return nil
}

// release gives c back, retrying until the settle timeout, on a context
// detached from ctx's cancellation.
func (d *delivery) release(ctx context.Context, c store.Claim) error {
	return settle(ctx, d.cfg, func(ctx context.Context) error {
		return retryUntilDone(ctx, func() error { return d.b.Release(ctx, c) })
	})
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

// beat is what a body's heartbeat learned, and how it acts on a lost
// claim (see lose).
type beat struct {
	cancel context.CancelCauseFunc // cancels the body's context
	// tx reports a body that runs inside the backend's transaction
	// (LockTx): the renewal that finds the claim lost may be looking at
	// the transaction's own Done mark.
	tx bool
	// inBody is set while a transactional body runs (an attempt of it:
	// the store may run it again).
	inBody atomic.Bool
	// lost is set, by the renewing goroutine, once a renewal found the
	// claim lost (store.ErrLost); cut once that cancelled a running body
	// (under Lock and Mutex, always).
	lost, cut atomic.Bool
}

// lose acts on a renewal of claim that answered err, wrapping
// store.ErrLost. Under Lock and Mutex the claim is gone while the body
// runs beside another holder: it says so loudly and cancels the body.
// Under LockTx nothing is logged here: the renewal may have found the
// Done mark of the body's own commit (a renewal that lands between the
// mark and the commit's reply), which only the transaction's outcome
// tells apart from a claim superseded by another delivery (settleTx logs
// that one); the body is cancelled only while it runs, never during
// the commit.
func (h *beat) lose(ctx context.Context, cfg *lockConfig, claim store.Claim, err error) {
	h.lost.Store(true)
	cause := fmt.Errorf("idempotency: lease renewal: %w", err)
	if h.tx {
		if h.inBody.Load() {
			h.cut.Store(true)
			h.cancel(cause)
		}
		return
	}
	h.cut.Store(true)
	cfg.log().ErrorContext(ctx, "idempotency: the claim was lost while the work ran (another delivery took the key); cancelling the work",
		"key", claim.Key, "fence", claim.Fence, "error", err)
	h.cancel(cause)
}

// enter marks the start of an attempt of a transactional body; once the
// claim is known lost, the attempt's context is cancelled at once.
func (h *beat) enter() {
	if h == nil {
		return
	}
	h.inBody.Store(true)
	if h.lost.Load() {
		h.cut.Store(true)
		h.cancel(fmt.Errorf("idempotency: lease renewal: %w", store.ErrLost))
	}
}

// leave marks the end of an attempt of a transactional body.
func (h *beat) leave() {
	if h != nil {
		h.inBody.Store(false)
	}
}

// cutBody reports whether a renewal found the claim lost while the body
// ran, and cancelled it; read it after the heartbeat stopped. A loss
// found after a transactional body returned is not counted: the
// transaction's own outcome tells what happened then (the commit's own
// mark, a commit that failed and was settled by releasing the claim, or
// a claim superseded before the mark, which the mark then refuses).
func (h *beat) cutBody() bool { return h != nil && h.cut.Load() }

// heartbeat renews *c every cfg.heartbeat until the returned stop is
// called (stop waits for the renewing goroutine, after which *c holds the
// latest claim). A renewal that finds the claim lost ends the renewals
// and calls lose (see beat.lose).
func heartbeat(ctx context.Context, b store.Backend, c *store.Claim, cfg *lockConfig, lose func(context.Context, *lockConfig, store.Claim, error)) (stop func()) {
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
					// The body returned (under LockTx, its transaction
					// ended) while the renewal ran: a transactional
					// body's commit marked the key done, which a renewal
					// finds "lost". Nothing was.
					return
				default:
				}
				lose(ctx, cfg, claim, err)
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
