package idempotency

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// TxEventFunc is a CloudEvent function whose effects are writes in tx, a
// transaction of the backend's own store (see [IdempotentTx]).
type TxEventFunc[Tx any] = func(ctx context.Context, e event.Event, tx Tx) error

// LockTx is [Lock] for a body whose effects are writes to the store that
// keeps the idempotency records (the same SQL database, Spanner database,
// Datastore or Firestore project): fn receives a transaction of that store,
// and the key is marked done in the same transaction, which commits once.
// The body's writes and the done mark then exist together or not at all:
// a process killed at any point before the commit leaves neither (the next
// delivery runs fn again, from scratch), and a holder whose lease lapsed
// and who was replaced cannot commit: its transaction is rolled back.
//
// Outcomes, as for Lock, except after fn ran:
//
//   - fn returns nil and the transaction commits: LockTx returns nil.
//   - fn returns an error: the transaction is rolled back, the claim
//     released, and LockTx returns fn's error unchanged.
//   - the claim was superseded before the commit (its lease lapsed and
//     another delivery took the key, or it was released): rolled back,
//     nothing committed; LockTx returns an *[InProgressError] with
//     Superseded set (errors.Is ErrInProgress: nack, retry later), or an
//     error wrapping one and, when fn returned an error, fn's error too.
//     Under [WithHeartbeat] a renewal that finds the claim gone while fn
//     runs cancels fn's context (a renewal that finds the key done by
//     fn's own commit, landing between the mark and the commit's reply,
//     is not a loss: the delivery succeeds and nothing is logged).
//   - the commit failed: the claim is released and LockTx returns the
//     error. A commit whose reply was lost is settled by the backend
//     before it answers; an outcome it cannot settle is an error wrapping
//     [store.ErrCommitUnknown] (nack: a redelivery finds the key done if
//     the commit landed).
//
// The store may run fn more than once, each time in a fresh transaction,
// when it retries a transaction (an abort, a conflict); only the writes
// of the attempt that commits exist. What fn does outside tx (a call to
// another service, a message sent) can happen once per attempt: keep it
// out of fn, or make it idempotent itself.
//
// fn must return every error that a statement on tx returned (wrapped or
// not), and never go on with tx after one: a failed statement may have
// ended the whole transaction on the server (MySQL and MariaDB roll it
// back on a deadlock and carry on outside any transaction; PostgreSQL
// aborts it on any error), taking fn's earlier writes with it. A backend
// that can tell refuses to mark the key done in a transaction that is no
// longer open (see its CompleteTx); returning the error lets the store
// retry the transaction, or nacks.
//
// fn's context carries the claim ([ClaimFrom]) and, under [WithHeartbeat],
// is cancelled when the claim is lost, which rolls the transaction back.
// A panic in fn rolls back, releases the claim, and continues.
func LockTx[Tx any](ctx context.Context, b store.TxBackend[Tx], key string, fn func(ctx context.Context, tx Tx) error, opts ...LockOption) error {
	if fn == nil {
		return errors.New("idempotency: nil body")
	}
	cfg := newLockConfig(opts...)
	var sb store.Backend
	if b != nil {
		sb = b
	}
	return delivery{b: sb, key: key, fp: cfg.fingerprint, cfg: &cfg}.run(ctx, body{tx: txOf(b, fn)}).err
}

// IdempotentTx is [Idempotent] for a handler whose effects are writes to
// the backend's own store: the handler receives a transaction of that
// store, and the event's key is marked done in the same transaction (see
// [LockTx] for what that guarantees and for handlers the store runs more
// than once). The outcomes and statuses are Idempotent's, with these
// differences:
//
//	claim superseded while the handler ran   503 result   503, nack; nothing committed
//	the transaction did not commit           that error   500, nack; claim released
//	DisableEnv set                           500 result   500, nack; handler not run
//
// A handler that ran and whose transaction committed is acknowledged;
// anything else is a nack, and the redelivery finds the key done exactly
// when the handler's writes exist. IdempotentTx panics on what Idempotent
// panics on, and on [AllowUnguarded], which it cannot honour: without a
// claim there is no transaction to give the handler.
func IdempotentTx[Tx any](b store.TxBackend[Tx], opts ...Option) func(TxEventFunc[Tx]) CloudEventFunc {
	refusePushOptions("IdempotentTx", opts)
	return idempotentTx("IdempotentTx", b, opts)
}

// idempotentTx is IdempotentTx without the refusal of PushHandler's
// options, for PushHandlerTx; fn names the caller in panics.
func idempotentTx[Tx any](fn string, b store.TxBackend[Tx], opts []Option) func(TxEventFunc[Tx]) CloudEventFunc {
	var sb store.Backend
	if b != nil {
		sb = b
	}
	cfg := newGuardConfig(fn, sb, opts)
	if cfg.unguarded {
		panic("idempotency." + fn + ": AllowUnguarded cannot be honoured: a transactional handler needs the transaction that only a claim opens")
	}
	return func(h TxEventFunc[Tx]) CloudEventFunc {
		if h == nil {
			panic("idempotency." + fn + ": nil handler")
		}
		return cfg.guard(sb, nil, func(e event.Event) txFunc {
			return txOf(b, func(ctx context.Context, tx Tx) error { return h(ctx, e, tx) })
		})
	}
}

// PushHandlerTx is [PushHandler] for a transactional handler (see
// [IdempotentTx]): the same requests, statuses and options, with h run
// inside the backend's transaction that marks the key done.
func PushHandlerTx[Tx any](b store.TxBackend[Tx], h TxEventFunc[Tx], opts ...Option) http.Handler {
	return pushHandler("PushHandlerTx", opts, func() CloudEventFunc { return idempotentTx("PushHandlerTx", b, opts)(h) })
}

// txFunc runs the body inside the backend's transaction that completes c
// (store.TxCompleter.CompleteTx). enter makes each attempt's body context
// from the transaction's, and leave is called when that attempt's body
// returns.
type txFunc func(ctx context.Context, c store.Claim, fp string, enter func(context.Context) context.Context, leave func()) txResult

// txResult is what became of a transactional body: ran reports whether
// the body was called, bodyErr what its last call returned, done and err
// what CompleteTx returned.
type txResult struct {
	ran     bool
	bodyErr error
	done    bool
	err     error
}

// txOf binds fn to b's CompleteTx.
func txOf[Tx any](b store.TxCompleter[Tx], fn func(ctx context.Context, tx Tx) error) txFunc {
	return func(ctx context.Context, c store.Claim, fp string, enter func(context.Context) context.Context, leave func()) (r txResult) {
		r.done, r.err = b.CompleteTx(ctx, c, fp, func(tctx context.Context, tx Tx) error {
			r.ran = true
			defer leave()
			r.bodyErr = fn(enter(tctx), tx) // each attempt's: only the last one counts
			return r.bodyErr
		})
		return r
	}
}

// settleTx maps what became of the transactional body under claim c to
// LockTx's answer, releasing c where the transaction did not commit and c
// may still be this delivery's. cut reports that a renewal found the
// claim gone while the body ran, and cancelled it: superseded, unless the
// transaction committed all the same.
func (d *delivery) settleTx(ctx context.Context, tr *tracker, c store.Claim, cut bool, r txResult) error {
	key, log := d.key, d.cfg.log()
	switch {
	case r.err == nil && r.done:
		tr.settling(ctx, opComplete)
		tr.settled(ctx, true, nil)
		return nil
	case errors.Is(r.err, store.ErrCommitUnknown):
		// Said below, whatever the heartbeat saw: the commit may have
		// landed.
	case cut || (r.err == nil && (!r.ran || r.bodyErr == nil)):
		// Superseded: by the lease lapsing and another delivery claiming
		// the key, or by a release (an operator's). The mark did not
		// match (false, nil), or, under a heartbeat, the body was
		// cancelled when a renewal found the claim gone. Nothing
		// committed, and the key is not this delivery's to release.
		tr.settling(ctx, opComplete)
		tr.superseded(ctx)
		log.WarnContext(ctx, "idempotency: the claim was superseded before the transaction committed (its lease lapsed and another delivery claimed the key, or it was released); rolled back, nothing committed; nacking",
			"key", key, "fence", c.Fence, "lease_expiry", c.LeaseExpiry, "heartbeat", d.cfg.heartbeat > 0)
		ip := &InProgressError{Key: key, Superseded: true}
		switch {
		case r.ran && r.bodyErr != nil:
			return fmt.Errorf("%w (the body returned: %w)", ip, r.bodyErr)
		case r.err != nil:
			return fmt.Errorf("%w (the transaction: %w)", ip, r.err)
		}
		return ip
	case r.ran && r.bodyErr != nil:
		rerr := d.release(tr.settling(ctx, opRelease), c)
		tr.settled(ctx, true, rerr)
		if rerr != nil {
			log.WarnContext(ctx, "idempotency: release failed; the key frees when its lease lapses",
				"key", key, "fence", c.Fence, "lease_expiry", c.LeaseExpiry, "error", rerr)
		}
		return r.bodyErr
	}
	tr.settling(ctx, opComplete)
	tr.settled(ctx, false, r.err)
	if rerr := d.release(ctx, c); rerr != nil {
		log.WarnContext(ctx, "idempotency: release after a failed transaction failed; the key frees when its lease lapses",
			"key", key, "fence", c.Fence, "error", rerr)
	}
	log.ErrorContext(ctx, "idempotency: the transaction with the body's writes and the done mark did not commit; nacking",
		"key", key, "fence", c.Fence, "error", r.err)
	return fmt.Errorf("idempotency: key %q: the transaction did not commit: %w", key, r.err)
}
