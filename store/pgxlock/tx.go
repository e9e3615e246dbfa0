package pgxlock

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/internal/dialect"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

var _ store.TxBackend[pgx.Tx] = (*Backend)(nil)

// SettleTimeout bounds the settling of a commit whose reply was lost (see
// CompleteTx): the release that fences the commit out, and the read of
// the record. It runs on a context detached from the caller's
// cancellation.
const SettleTimeout = 30 * time.Second

// CommitIdleTimeout bounds, on the server, how long a transaction of
// CompleteTx stays open after its Done mark's UPDATE (which locks c's
// record) while its commit does not arrive: the mark's UPDATE sets
// idle_in_transaction_session_timeout for the rest of the transaction, as
// sqllock's does, so a frozen client cannot hold the row lock longer.
const CommitIdleTimeout = dialect.CommitIdleMillis * time.Millisecond

// CompleteTx implements store.TxCompleter with pgx.Tx: the caller's rows,
// written by body on tx (directly, or through sqlc-generated queries'
// WithTx(tx)), and the Done mark commit together, or neither does. It is
// sqllock's CompleteTx on PostgreSQL, on pgx's transaction:
//
// It checks c.Key and fp (as CompleteFingerprint does; "" stores none)
// and that body is not nil before any I/O. Then it begins a transaction
// (WithTxOptions), sets the transaction-local setting sqllock.tx_marker
// to a number no earlier transaction of the process used, calls body
// with it, and after body returns nil runs, in the same transaction,
// Complete's UPDATE with two more conditions: the record must still be
// Claimed (state 1) by c's fence and token, and the setting must still
// hold the transaction's marker (a ROLLBACK or COMMIT statement of body
// takes it away). It then commits once.
//
//   - true, nil: the transaction committed, with body's writes and the
//     Done mark.
//   - false, nil: the record is not Claimed by c (c's lease lapsed and
//     another claim took the key, c was released, or already completed):
//     the transaction is rolled back, none of body's writes exist.
//   - body's error, or a panic of body: the transaction is rolled back
//     (a panic then goes on up); the record stays Claimed by c.
//   - body returned nil, but the transaction had ended under it: a
//     failed statement aborted it (body swallowed the error), or a
//     ROLLBACK or COMMIT statement on tx, or body's own tx.Commit or
//     tx.Rollback, ended it: an error, and the Done mark is not written
//     (after a COMMIT, body's writes before it exist without it).
//   - A commit whose reply was lost (a connection cut, or ctx ending
//     while the commit was under way) is settled before CompleteTx
//     returns, on a context detached from ctx's cancellation and bounded
//     by SettleTimeout: c is released if its record is still Claimed by
//     c (the release waits for the row lock of a commit still in flight),
//     and the record is read. Done by c: true, nil. Still c's (now
//     released): an error, nothing committed. When the release or the
//     read fails, or the record moved on to another claim, the error
//     wraps store.ErrCommitUnknown.
//
// A serialization failure or a deadlock (SQLSTATE 40001, 40P01) returned
// by body, by the UPDATE or by the commit rolls the transaction back and
// runs the whole of it again, body included, within WithRetries' budget.
// When the attempts end with the UPDATE refused because c's record
// changed after the transaction's snapshot (40001 at REPEATABLE READ or
// SERIALIZABLE), the error wraps ErrSnapshotConflict.
//
// On a *pgx.Conn, CompleteTx holds the connection for the whole call: it
// first waits for a lease renewal (Extend) in flight to end, and a
// CompleteTx called inside its body on the same backend fails at once.
//
// Round trips, besides body's statements: begin, the marker, the UPDATE,
// the commit.
func (b *Backend) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(ctx context.Context, tx pgx.Tx) error) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	if err := store.ValidateFingerprint(fp); err != nil {
		return false, err
	}
	if body == nil {
		return false, fmt.Errorf("pgxlock: complete-tx %q: nil body", c.Key)
	}
	if b.single {
		if ctx.Value(holdsConn{}) == b {
			return false, fmt.Errorf("pgxlock: complete-tx %q: called inside a body of CompleteTx on the same backend, "+
				"whose transaction holds the backend's only connection (a *pgx.Conn); give the backend a pool", c.Key)
		}
		// The connection is the transaction's until the outcome is
		// settled: a renewal in flight ends first, and later ones fail
		// at once (Extend).
		b.one.Lock()
		defer b.one.Unlock()
		ctx = context.WithValue(ctx, holdsConn{}, b)
	}
	var done bool
	var lost error
	attempts := 0
	err := b.backoff.Do(ctx, func(int) error {
		attempts++
		ok, unsure, err := b.completeTxOnce(ctx, c, fp, body)
		if unsure {
			lost = err
			return nil
		}
		done = ok
		return err
	}, retryTx)
	if lost != nil {
		return b.settle(ctx, c, lost)
	}
	if err != nil {
		if errors.Is(err, errRecordChanged) {
			return false, fmt.Errorf("pgxlock: complete-tx %q fence %d: %w (%d attempts, the last one's error: %w)", c.Key, c.Fence, ErrSnapshotConflict, attempts, err)
		}
		return false, fmt.Errorf("pgxlock: complete-tx %q fence %d: %w", c.Key, c.Fence, b.explain(err))
	}
	return done, nil
}

// holdsConn is the context key under which CompleteTx on a *pgx.Conn
// marks its body's context with the backend whose connection it holds.
type holdsConn struct{}

// ErrSnapshotConflict is wrapped by CompleteTx's error when its attempts
// ended with the Done mark's UPDATE refused because c's record changed
// after the transaction's snapshot was taken (REPEATABLE READ or
// SERIALIZABLE: SQLSTATE 40001), as a WithHeartbeat renewal during a body
// longer than one heartbeat period does. Nothing committed.
var ErrSnapshotConflict = errors.New("pgxlock: the claim's record changed during the body under snapshot isolation " +
	"(a lease renewal by WithHeartbeat, or another writer, updated it after the transaction's snapshot was taken), " +
	"so the Done mark's UPDATE was refused in every attempt and nothing committed; " +
	"run CompleteTx at READ COMMITTED (WithTxOptions), or keep the body shorter than the heartbeat period")

var errRecordChanged = errors.New("pgxlock: the record changed since the transaction's snapshot")

// errTxAborted wraps the refusal of the mark in a transaction a failed
// statement of body aborted.
var errTxAborted = errors.New("pgxlock: the transaction was aborted under the body by a failed statement whose error body did not return; " +
	"nothing committed, and the Done mark was not written (the delivery is nacked and runs again)")

// errTxEndedByStatement ends an attempt whose transaction a ROLLBACK or
// COMMIT statement of body ended.
var errTxEndedByStatement = errors.New("pgxlock: the transaction was ended under the body by a ROLLBACK or COMMIT statement on tx, " +
	"and the Done mark was not written: after a ROLLBACK nothing committed (the delivery is nacked and runs again); " +
	"after a COMMIT the body's writes before it exist without the mark")

// The transaction's marker: a setting local to the transaction.
const (
	writeMarker = "SELECT set_config('" + dialect.PgTxMarker + "', $1, true)"
	readMarker  = "SELECT current_setting('" + dialect.PgTxMarker + "', true) IS NOT DISTINCT FROM $1"
)

// txMarkers numbers the transactions of CompleteTx in this process,
// from a random start.
var txMarkers atomic.Int64

func init() { txMarkers.Store(rand.Int64N(1 << 62)) }

func sqlState(err error) string {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Code
	}
	return ""
}

// txEnded adds to err, returned by a statement on tx after body returned,
// that body must have ended tx itself.
func txEnded(ctx context.Context, what string, err error) error {
	if errors.Is(err, pgx.ErrTxClosed) && ctx.Err() == nil {
		return fmt.Errorf("%s: the transaction was ended (did body commit or roll back tx?): %w", what, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// completeTxOnce is one attempt of CompleteTx. unsure reports a commit
// that failed in a way that may have let it land (err is then the
// commit's error).
func (b *Backend) completeTxOnce(ctx context.Context, c store.Claim, fp string, body func(ctx context.Context, tx pgx.Tx) error) (done, unsure bool, err error) {
	b.txConns.Add(1)
	defer b.txConns.Add(-1)
	tx, err := b.db.BeginTx(ctx, b.txOpts)
	if err != nil {
		return false, false, fmt.Errorf("begin: %w", err)
	}
	ended := false
	defer func() {
		// Also on a panic of body: the transaction is rolled back before
		// the panic goes on, and the connection goes back to the pool.
		if !ended {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), SettleTimeout)
			tx.Rollback(rctx)
			cancel()
		}
	}()
	marker := strconv.FormatInt(txMarkers.Add(1), 10)
	if _, err := tx.Exec(ctx, writeMarker, marker); err != nil {
		return false, false, fmt.Errorf("writing the transaction's marker: %w", err)
	}
	if err := body(ctx, tx); err != nil {
		return false, false, fmt.Errorf("body: %w", err)
	}
	var v any
	err = tx.QueryRow(ctx, b.q.CompleteTx, []byte(c.Key), c.Fence, millis(b.ttl), c.Token, dialect.Stamp(c.Fence, fp), marker).Scan(&v)
	matched := err == nil
	if errors.Is(err, pgx.ErrNoRows) {
		err = nil
	}
	if err != nil {
		switch sqlState(err) {
		case "40001":
			err = fmt.Errorf("%w: %w", errRecordChanged, err)
		case "25P02":
			err = fmt.Errorf("%w: %w", errTxAborted, err)
		}
		return false, false, txEnded(ctx, "marking done", err)
	}
	if !matched {
		// Tell a transaction a ROLLBACK or COMMIT statement ended from a
		// claim fenced out.
		var open bool
		if err := tx.QueryRow(ctx, readMarker, marker).Scan(&open); err != nil {
			return false, false, fmt.Errorf("checking that the transaction is open: %w", err)
		}
		if !open {
			return false, false, errTxEndedByStatement
		}
		return false, false, nil
	}
	ended = true
	if err := tx.Commit(ctx); err != nil {
		if errors.Is(err, pgx.ErrTxCommitRollback) || errors.Is(err, pgx.ErrTxClosed) {
			return false, false, fmt.Errorf("commit: %w", err)
		}
		if mayHaveLanded(err) {
			return false, true, err
		}
		return false, false, fmt.Errorf("commit: %w", err)
	}
	return true, false, nil
}

// settle decides a commit that failed with cause, which may have landed:
// it fences the commit out by releasing c if its record is still Claimed
// by c, then reads the record.
func (b *Backend) settle(ctx context.Context, c store.Claim, cause error) (bool, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), SettleTimeout)
	defer cancel()
	k := []byte(c.Key)
	var r row
	var found bool
	_, err := b.release(ctx, k, c.Fence, c.Token)
	if err == nil {
		err = b.retry(ctx, func() error {
			var err error
			r, found, err = b.read(ctx, b.db, k)
			return err
		})
	}
	if err != nil {
		return false, fmt.Errorf("pgxlock: complete-tx %q fence %d: the commit's outcome is unknown (%w), and settling it failed: %w: %w", c.Key, c.Fence, cause, store.ErrCommitUnknown, err)
	}
	switch {
	case found && r.State == 2 && r.Fence == c.Fence && r.Token == c.Token:
		return true, nil
	case found && r.Token == c.Token:
		return false, fmt.Errorf("pgxlock: complete-tx %q fence %d: the commit failed (%w); it did not land, and the claim is released", c.Key, c.Fence, cause)
	}
	return false, fmt.Errorf("pgxlock: complete-tx %q fence %d: the commit's outcome is unknown (%w), and the record has moved on to another claim since: %w", c.Key, c.Fence, cause, store.ErrCommitUnknown)
}

// retryTx reports whether a CompleteTx attempt that failed with err is
// run again, body included: a serialization failure or a deadlock.
func retryTx(err error) bool {
	s := sqlState(err)
	return s == "40001" || s == "40P01"
}
