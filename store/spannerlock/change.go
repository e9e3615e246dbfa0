package spannerlock

import (
	"context"
	"fmt"
	"time"

	"cloud.google.com/go/spanner"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// guard is the WHERE clause of Complete, Release and Extend: the row of
// the claim's key, fence and token.
const guard = " WHERE key = @key AND fence = @fence AND token = @token"

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
			"fingerprint = IF(state = 1, @fp, fingerprint)" + guard,
		Params: p,
	}
	var (
		n       int64
		wrote   bool
		unknown bool
	)
	err := b.transact(ctx, func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
		// The Spanner client runs the body again after a Commit that
		// failed with Aborted, Internal or ResourceExhausted, without
		// saying which: the last run's write may have applied.
		unknown = unknown || wrote
		wrote = false
		var err error
		n, err = txn.Update(ctx, stmt)
		wrote = err == nil && n > 0
		return err
	}, func(err error) error {
		unknown = unknown || wrote && unknownCommit(err)
		wrote = false
		return err
	})
	if err == nil && n == 0 && unknown {
		// An earlier commit may have completed the row, which has changed
		// hands since.
		err = errUnknown
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
// transaction (NotFound or FailedPrecondition naming it) is such a
// failure: it may answer a Commit the Spanner client resent after the
// first applied. Runs that certainly applied nothing (an aborted
// transaction, a statement that failed) are run again as any call's.
func (b *Backend) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return c, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return c, err
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
		if matched && unknownCommit(err) {
			return fmt.Errorf("%w: %w", errNoResend, err)
		}
		return err
	})
	if err != nil {
		return c, fmt.Errorf("spannerlock: extend %q fence %d: %w", c.Key, c.Fence, err)
	}
	if !found {
		return c, fmt.Errorf("spannerlock: extend %q fence %d: %w", c.Key, c.Fence, store.ErrLost)
	}
	c.LeaseExpiry = expiry
	return c, nil
}
