package spannerlock

import (
	"context"
	"errors"
	"fmt"
	"time"

	"cloud.google.com/go/spanner"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// guard is the WHERE clause of Complete, Release and Extend: the row of
// the claim's key, fence and token.
const guard = " WHERE key = @key AND fence = @fence AND token = @token"

// errCompleted ends a Complete whose Commit was answered as lost (NotFound
// or FailedPrecondition naming the transaction) by a strong read that
// found the row Done with the claim's fence and token.
var errCompleted = errors.New("spannerlock: the completion applied")

// errExtended ends an Extend whose Commit was answered as lost (NotFound or
// FailedPrecondition naming the transaction) by a strong read that found
// the extension applied.
var errExtended = errors.New("spannerlock: the extension applied")

func (b *Backend) params(c store.Claim) map[string]any {
	return map[string]any{"key": []byte(c.Key), "fence": c.Fence, "token": c.Token, "ttl": micros(b.ttl)}
}

// Complete marks the claim's row Done in one DML statement that matches
// key, fence and token (2 RPCs with the commit), and clears the row's
// fingerprint. A Done row with the same fence and token matches too and
// keeps its expires_at and fingerprint.
func (b *Backend) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return b.complete(ctx, c, "")
}

// CompleteFingerprint is [Backend.Complete] that also stores fp, a payload
// fingerprint, in the row it moves to Done (none when fp is empty); a
// Claim that finds the row Done reports it in Result.Fingerprint. It
// refuses an fp that store.ValidateFingerprint refuses, before any I/O.
// The row keeps it in the nullable column fingerprint, STRING(128).
func (b *Backend) CompleteFingerprint(ctx context.Context, c store.Claim, fp string) (bool, error) {
	if err := store.ValidateFingerprint(fp); err != nil {
		return false, fmt.Errorf("spannerlock: complete %q fence %d: %w", c.Key, c.Fence, err)
	}
	return b.complete(ctx, c, fp)
}

func (b *Backend) complete(ctx context.Context, c store.Claim, fp string) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	p := b.params(c)
	p["fp"] = spanner.NullString{StringVal: fp, Valid: fp != ""}
	stmt := spanner.Statement{
		SQL: "UPDATE " + b.table + " SET state = 2, " +
			"expires_at = IF(state = 1, TIMESTAMP_ADD(CURRENT_TIMESTAMP(), INTERVAL @ttl MICROSECOND), expires_at), " +
			"fingerprint = IF(state = 1, @fp, fingerprint)" + guard + " THEN RETURN expires_at",
		Params: p,
	}
	var (
		n int64
		// exp is the expires-at instant the last run's statement stored,
		// zero when it matched nothing.
		exp time.Time
		// maybe is the earliest expires-at instant that a run whose
		// Commit may have applied stored (zero for none): had that
		// Commit applied, the row would be Done with c's fence and token
		// until then at least, and the statement would match it.
		maybe time.Time
		// now is when the last run found the row not c's, when maybe
		// is set.
		now time.Time
	)
	mayHave := func() {
		if !exp.IsZero() && (maybe.IsZero() || exp.Before(maybe)) {
			maybe = exp
		}
		exp = time.Time{}
	}
	err := b.transact(ctx, func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
		// The Spanner client runs the body again after a Commit that
		// failed with Aborted, Internal or ResourceExhausted, without
		// saying which: the last run's write may have applied.
		mayHave()
		n, now = 0, time.Time{}
		err := txn.Query(ctx, stmt).Do(func(r *spanner.Row) error {
			n++
			return r.Columns(&exp)
		})
		if err != nil || n > 0 || maybe.IsZero() {
			return err
		}
		return txn.Query(ctx, spanner.Statement{SQL: "SELECT CURRENT_TIMESTAMP()"}).Do(func(r *spanner.Row) error {
			return r.Columns(&now)
		})
	}, func(err error) error {
		if !exp.IsZero() && unknownCommit(err) && txLost(err) {
			// Unless the Spanner client resent the Commit after a lost
			// reply, the transaction is gone and wrote nothing (the
			// emulator forgets all but one of a database's concurrent
			// transactions). A strong read tells, before exp.
			if r, rerr := b.read(ctx, b.client.Single(), c.Key); rerr == nil {
				switch {
				case r.present && r.state == stateDone && r.fence == c.Fence && r.token == c.Token:
					n = 1
					return errCompleted
				case r.now.Before(exp):
					exp = time.Time{} // it did not apply
				}
			}
		}
		if unknownCommit(err) {
			mayHave()
		}
		exp = time.Time{}
		return err
	})
	if errors.Is(err, errCompleted) {
		err = nil
	}
	if err == nil && n == 0 && !maybe.IsZero() && !now.Before(maybe) {
		// An earlier commit may have completed the row, which may have
		// expired and changed hands since; read before maybe, the row
		// would have been Done with c's fence and token.
		err = fmt.Errorf("%w (a write that may have applied stored expires-at %v; the row was not Done with this claim at %v)", errUnknown, maybe, now)
	}
	if err != nil {
		return false, fmt.Errorf("spannerlock: complete %q fence %d: %w", c.Key, c.Fence, err)
	}
	return n > 0, nil
}

// Release sets the claim's row's lease expiry to CURRENT_TIMESTAMP() and
// raises its fence, in one DML statement that matches key, fence, token
// and state Claimed (2 RPCs with the commit). A repeat matches nothing.
func (b *Backend) Release(ctx context.Context, c store.Claim) error {
	if err := store.ValidateKey(c.Key); err != nil {
		return err
	}
	stmt := spanner.Statement{
		SQL: "UPDATE " + b.table + " SET fence = fence + 1, lease_expiry = CURRENT_TIMESTAMP(), " +
			"expires_at = TIMESTAMP_ADD(CURRENT_TIMESTAMP(), INTERVAL @ttl MICROSECOND)" + guard + " AND state = 1",
		Params: b.params(c),
	}
	err := b.transact(ctx, func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
		_, err := txn.Update(ctx, stmt)
		return err
	}, nil)
	if err != nil {
		return fmt.Errorf("spannerlock: release %q fence %d: %w", c.Key, c.Fence, err)
	}
	return nil
}

// Extend sets the claim's lease to run for lease from CURRENT_TIMESTAMP(),
// in one DML statement that matches key, fence, token and state Claimed
// and returns the new lease expiry (2 RPCs with the commit). It returns an
// error wrapping store.ErrLost when nothing matched.
//
// A call renews the lease at most once: a run whose statement matched the
// row and whose Commit failed in a way that leaves it unknown whether it
// applied is not followed by another (which would renew the lease again
// from a later instant); Extend returns that error instead. A lost
// transaction (NotFound or FailedPrecondition naming it) may be such a
// failure (it may answer a Commit the Spanner client resent after the
// first applied) or not (the emulator forgot the transaction for a
// concurrent one): a strong read of the row settles it, and Extend
// returns the lease it finds stored by that run, or runs again when the
// row does not hold it. Runs that certainly applied nothing (an aborted
// transaction, a statement that failed) are run again as any call's.
//
// On the emulator (SPANNER_EMULATOR_HOST set when the Backend was built),
// an Extend of a claim whose [Backend.CompleteTx] is running in this
// Backend waits until that call returns (or ctx ends, or the claim's
// LeaseExpiry passes: an error, not store.ErrLost, and nothing written)
// before it begins its transaction, unless it is called from the body itself (on the body's
// context): the emulator runs one read-write transaction
// at a time per database, so the renewal would abort the body's
// transaction and make the Spanner client run the body again, at every
// renewal (a body of 350ms under a 100ms heartbeat ran 101 times and
// never committed). The lease is then not renewed while the body runs;
// on the emulator any other call on the database aborts the body's
// transaction anyway. On Spanner the renewal runs at once: it writes only
// c's row, which the body's transaction does not touch before the Done
// mark.
func (b *Backend) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return c, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return c, err
	}
	if err := b.awaitTx(ctx, c); err != nil {
		return c, fmt.Errorf("spannerlock: extend %q fence %d: waiting for the claim's transaction: %w", c.Key, c.Fence, err)
	}
	p := b.params(c)
	p["lease"] = micros(lease)
	stmt := spanner.Statement{
		SQL: "UPDATE " + b.table + " SET lease_expiry = TIMESTAMP_ADD(CURRENT_TIMESTAMP(), INTERVAL @lease MICROSECOND), " +
			"expires_at = TIMESTAMP_ADD(TIMESTAMP_ADD(CURRENT_TIMESTAMP(), INTERVAL @lease MICROSECOND), INTERVAL @ttl MICROSECOND)" +
			guard + " AND state = 1 THEN RETURN lease_expiry",
		Params: p,
	}
	var (
		expiry time.Time
		found  bool
	)
	var matched bool // the last run's statement matched and returned
	err := b.transact(ctx, func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
		found, matched = false, false
		err := txn.Query(ctx, stmt).Do(func(r *spanner.Row) error {
			found = true
			return r.Columns(&expiry)
		})
		matched = err == nil && found
		return err
	}, func(err error) error {
		if !matched || !unknownCommit(err) {
			return err
		}
		if txLost(err) {
			// Unless the Spanner client resent the Commit after a lost
			// reply, the transaction is gone and wrote nothing. A strong
			// read tells: had the write applied, the row would hold
			// the lease expiry it returned (only the claim's own holder
			// changes it, and the holder is waiting for this call).
			if r, rerr := b.read(ctx, b.client.Single(), c.Key); rerr == nil {
				if r.present && r.fence == c.Fence && r.token == c.Token && r.lease.Equal(expiry) {
					return errExtended
				}
				found = false
				return err // nothing applied: run it again
			}
		}
		return fmt.Errorf("%w: %w", errNoResend, err)
	})
	if errors.Is(err, errExtended) {
		err = nil
	}
	if err != nil {
		return c, fmt.Errorf("spannerlock: extend %q fence %d: %w", c.Key, c.Fence, err)
	}
	if !found {
		return c, fmt.Errorf("spannerlock: extend %q fence %d: %w", c.Key, c.Fence, store.ErrLost)
	}
	c.LeaseExpiry = expiry
	return c, nil
}
