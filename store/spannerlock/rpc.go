package spannerlock

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"cloud.google.com/go/spanner"
	"google.golang.org/grpc/codes"
)

// errUnknown reports a call whose write may or may not have applied.
var errUnknown = errors.New("spannerlock: the outcome is unknown: a commit's reply was lost and the row no longer tells")

// errNoResend ends an Extend's runs: its Commit may have applied although
// its reply was lost, and another run would renew the lease again.
var errNoResend = errors.New("spannerlock: the extension may have been applied; not run again")

// retryable reports whether a failed transaction is worth running again:
// the codes of a transient failure, AlreadyExists (a concurrent Claim
// inserted the row first; the next run reads it), and a lost transaction.
func retryable(err error) bool {
	if errors.Is(err, errUnknown) || errors.Is(err, errNoResend) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	switch spanner.ErrCode(err) {
	case codes.Unavailable, codes.ResourceExhausted, codes.Internal, codes.DeadlineExceeded, codes.AlreadyExists:
		return true
	}
	return txLost(err)
}

// txLost reports an error that says the transaction did not commit and is
// gone: Aborted, or NotFound or FailedPrecondition naming the transaction
// (it was aborted or expired; the emulator answers so to all but one of
// the concurrent read-write transactions of a database).
func txLost(err error) bool {
	switch spanner.ErrCode(err) {
	case codes.Aborted:
		return true
	case codes.NotFound, codes.FailedPrecondition:
		desc := strings.ToLower(spanner.ErrDesc(err))
		// The Spanner client's refusal of a transaction begun under a
		// transaction's context ("does not support nested
		// transactions") names transactions too, and is final.
		return strings.Contains(desc, "transaction") && !strings.Contains(desc, "nested")
	}
	return false
}

// unknownCommit reports whether err, from a transaction whose body
// finished with writes to commit, leaves it unknown whether they applied:
// any failure but the definite ones (Aborted; an insert that found the
// row; a refused request). A lost transaction named by NotFound or
// FailedPrecondition is not definite: the Spanner client resends a Commit
// after Unavailable, and the emulator answers the resent one so once a
// newer transaction has begun, though the first one applied.
func unknownCommit(err error) bool {
	switch spanner.ErrCode(err) {
	case codes.Aborted, codes.AlreadyExists, codes.InvalidArgument, codes.PermissionDenied, codes.Unauthenticated:
		return false
	}
	return true
}

// maxLost bounds how often a call runs its transaction again after the
// transaction was lost (as the Spanner client reruns an aborted one, these
// do not count against WithRetries).
const maxLost = 100

// transact runs body in one read-write transaction (the Spanner client
// reruns it after an abort), runs it again after the transaction was lost
// (up to maxLost times), and runs the whole again per b.policy after any
// other retryable failure; failed, when set, hears of each failed run and
// returns the error to go on with (one wrapping errNoResend ends the
// call, whatever error it wraps).
func (b *Backend) transact(ctx context.Context, body func(ctx context.Context, txn *spanner.ReadWriteTransaction) error, failed func(err error) error) error {
	err := b.policy.Do(ctx, func(int) error {
		for n := 0; ; n++ {
			_, err := b.client.ReadWriteTransaction(ctx, body)
			if err != nil && failed != nil {
				err = failed(err)
			}
			if err == nil || !txLost(err) || errors.Is(err, errNoResend) || n >= maxLost || ctx.Err() != nil {
				return err
			}
			if b.policy.Wait(ctx, min(n, 6)) != nil {
				return err
			}
		}
	}, retryable)
	if spanner.ErrCode(err) == codes.InvalidArgument && strings.Contains(strings.ToLower(spanner.ErrDesc(err)), "fingerprint") {
		return fmt.Errorf("%w (the table lacks the fingerprint column: run EnsureSchema, or ALTER TABLE %s ADD COLUMN %s)", err, b.table, fingerprintColumn)
	}
	return err
}
