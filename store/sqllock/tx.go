package sqllock

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var _ store.TxBackend[*sql.Tx] = (*Backend)(nil)

// WithTxOptions sets the options of the transactions CompleteTx begins,
// for example sql.TxOptions{Isolation: sql.LevelSerializable}. Without it
// CompleteTx begins them with nil options: the driver's and the session's
// defaults (READ COMMITTED on PostgreSQL, REPEATABLE READ on MySQL and
// MariaDB, a deferred transaction on SQLite). ReadOnly makes New fail, as
// the Done mark is a write. The other verbs run single statements and do
// not use them.
func WithTxOptions(opts sql.TxOptions) Option {
	return func(b *Backend) { b.txOpts = &opts }
}

// SettleTimeout bounds the settling of a commit whose reply was lost (see
// CompleteTx): the release that fences the commit out, and the read of the
// record. It runs on a context detached from the caller's cancellation.
const SettleTimeout = 30 * time.Second

// CompleteTx implements store.TxCompleter on a *sql.Tx of the backend's
// own *sql.DB: the caller's rows and the Done mark commit together, or
// neither does.
//
// It checks c.Key and fp (as CompleteFingerprint does; "" stores none)
// and that body is not nil before any I/O. Then it begins a transaction
// (WithTxOptions), calls body with it, and after body returns nil runs, in
// the same transaction, Complete's UPDATE with one more condition: the
// record must still be Claimed (state 1) with c's fence and token. The
// record is not read or locked before body runs. The UPDATE writes what
// CompleteFingerprint writes (state 2, expires-at the database's now plus
// the ttl, the fingerprint stamped with the fence); it then commits once.
//
//   - true, nil: the transaction committed, with body's writes and the
//     Done mark.
//   - false, nil: the record is not Claimed with c's fence and token (c
//     was replaced after its lease lapsed, released, or already
//     completed): the transaction is rolled back, none of body's writes
//     exist, and body did run.
//   - body's error: the transaction is rolled back and the error returned
//     wraps body's; the record stays Claimed by c (release it, or let the
//     lease lapse).
//   - A commit whose reply was lost (a connection cut, or ctx ending while
//     the commit was under way) is settled before CompleteTx returns, on
//     a context detached from ctx's cancellation and bounded by
//     SettleTimeout: c is released if its record is still Claimed by c
//     (the release waits for the row lock of a commit still in flight, so
//     that commit either landed first or can no longer land), and then
//     the record is read. Done with c's fence and token: true, nil. Still
//     c's (now released): an error, nothing committed. When the release or
//     the read fails, or the record has moved on to another claim, the
//     error wraps store.ErrCommitUnknown: body's writes and the mark
//     both exist or neither does.
//   - Any other error: nothing committed.
//
// A serialization failure or a deadlock (PostgreSQL SQLSTATE 40001 or
// 40P01, MySQL error 1213, MariaDB 1020 "record has changed since last
// read" under innodb_snapshot_isolation) returned by body, by the UPDATE
// or by the commit, and SQLITE_BUSY or SQLITE_LOCKED returned by body or
// the UPDATE (SQLite's answer to a transaction whose snapshot is stale
// when it first writes), rolls the transaction back and runs the whole
// of it again, body included, with a fresh transaction, within
// WithRetries' budget and backoff. Only the writes of the transaction
// that commits exist; whatever body does outside the transaction (calls
// to other services, messages sent) may happen once per call. Return such
// an error from body (wrapped or not) to have the transaction retried.
// Other errors, a broken connection among them, are not retried.
//
// Body must leave the transaction open: a body that commits or rolls
// back tx itself makes the UPDATE fail with sql.ErrTxDone (and if it
// committed, its writes exist without the mark).
//
// ctx governs the transaction: a ctx that ends before the commit rolls it
// back (database/sql does).
//
// What it holds, and for how long:
//
//   - c's record is locked only from the UPDATE to the commit: on
//     PostgreSQL and MySQL a concurrent Claim of the key during body gets
//     its prompt HeldByOther. A reclaim that commits while the
//     transaction is open (c's lease lapsed) makes the UPDATE match
//     nothing: on PostgreSQL at READ COMMITTED each statement reads the
//     latest committed rows, and an UPDATE waiting on a reclaim's row lock
//     re-checks its condition on the reclaimed row; on MySQL the UPDATE
//     is a locking read of the latest committed row at any isolation
//     level (MariaDB with innodb_snapshot_isolation=ON fails it with
//     error 1020 instead, and the transaction is retried). At REPEATABLE
//     READ or SERIALIZABLE on PostgreSQL such a reclaim makes the UPDATE
//     fail with 40001, and the retry returns false.
//   - SQLite has one writer per database: from body's first write to the
//     commit, the transaction holds the database's write lock, and every
//     other write waits for it (up to the busy timeout, then SQLITE_BUSY,
//     which the verbs retry WithRetries times) — a concurrent Claim of
//     any key, this one included, waits for the commit and then answers
//     AlreadyDone (or, after false or an error, HeldByOther or Won),
//     rather than a prompt HeldByOther. A body that only reads holds no
//     write lock, and a Claim during it is answered at once.
//   - Body should end well within c's lease: after the lease lapses
//     another caller may take the key, and the UPDATE then finds it
//     replaced (false, body's writes rolled back). Extend the lease for
//     longer work.
//   - A long transaction has the engine's costs: PostgreSQL keeps the
//     rows body wrote locked and holds back vacuum's horizon
//     (idle_in_transaction_session_timeout and statement_timeout may end
//     it); InnoDB keeps body's row locks (others wait up to
//     innodb_lock_wait_timeout, 50 s by default, then fail with 1205) and
//     its undo history; SQLite blocks every other writer. Keep body to
//     the writes that must commit with the mark.
func (b *Backend) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(ctx context.Context, tx *sql.Tx) error) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	if err := store.ValidateFingerprint(fp); err != nil {
		return false, err
	}
	if body == nil {
		return false, fmt.Errorf("sqllock: complete-tx %q: nil body", c.Key)
	}
	k := []byte(c.Key)
	stamped := stamp(c.Fence, fp)
	var done bool
	// lost is the error of a commit whose reply did not arrive: the
	// attempts stop, and the outcome is settled.
	var lost error
	err := b.backoff.Do(ctx, func(int) error {
		ok, unsure, err := b.completeTxOnce(ctx, c, k, stamped, body)
		if unsure {
			lost = err
			return nil
		}
		done = ok
		return err
	}, retryTx)
	if lost != nil {
		return b.settle(ctx, c, k, lost)
	}
	if err != nil {
		return false, fmt.Errorf("sqllock: complete-tx %q fence %d: %w", c.Key, c.Fence, b.explain(err))
	}
	return done, nil
}

// completeTxOnce is one attempt of CompleteTx: a transaction, body, the
// UPDATE and the commit. unsure reports a commit that failed in a way
// that may have let it land (err is then the commit's error).
func (b *Backend) completeTxOnce(ctx context.Context, c store.Claim, k []byte, stamped any, body func(ctx context.Context, tx *sql.Tx) error) (done, unsure bool, err error) {
	st, err := b.stmt(ctx, b.q.CompleteClaimed)
	if err != nil {
		return false, false, err
	}
	tx, err := b.db.BeginTx(ctx, b.txOpts)
	if err != nil {
		return false, false, fmt.Errorf("begin: %w", err)
	}
	committing := false
	defer func() {
		if !committing {
			tx.Rollback()
		}
	}()
	if err := body(ctx, tx); err != nil {
		return false, false, fmt.Errorf("body: %w", err)
	}
	mark := tx.StmtContext(ctx, st)
	if b.q.Returning {
		var one int
		err = mark.QueryRowContext(ctx, k, c.Fence, millis(b.ttl), c.Token, stamped).Scan(&one)
		if errors.Is(err, sql.ErrNoRows) {
			return false, false, nil
		}
	} else {
		var res sql.Result
		if res, err = mark.ExecContext(ctx, millis(b.ttl), stamped, k, c.Fence, c.Token); err == nil {
			var n int64
			if n, err = res.RowsAffected(); err == nil && n != 1 {
				return false, false, nil
			}
		}
	}
	if err != nil {
		if errors.Is(err, sql.ErrTxDone) && ctx.Err() == nil {
			return false, false, fmt.Errorf("marking done: the transaction was ended (did body commit or roll back tx?): %w", err)
		}
		return false, false, fmt.Errorf("marking done: %w", err)
	}
	committing = true
	if err := tx.Commit(); err != nil {
		if errors.Is(err, sql.ErrTxDone) {
			// database/sql rolled the transaction back (ctx ended) before
			// the commit was sent.
			return false, false, fmt.Errorf("commit: %w", err)
		}
		if mayHaveLanded(err) {
			return false, true, err
		}
		if isSQLite(err) {
			// A failed COMMIT may leave SQLite's transaction open on the
			// connection: no new attempt beside it.
			err = fmt.Errorf("%w: %w", errCommitRefused, err)
		}
		return false, false, fmt.Errorf("commit: %w", err)
	}
	return true, false, nil
}

// settle decides a commit that failed with cause, which may have landed: it fences the
// commit out by releasing c if its record is still Claimed by c, then
// reads the record.
func (b *Backend) settle(ctx context.Context, c store.Claim, k []byte, cause error) (bool, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), SettleTimeout)
	defer cancel()
	var r row
	var found bool
	err := b.release(ctx, k, c)
	if err == nil {
		err = b.retry(ctx, func() error {
			var err error
			r, found, err = b.read(ctx, k)
			return err
		})
	}
	if err != nil {
		return false, fmt.Errorf("sqllock: complete-tx %q fence %d: the commit's outcome is unknown (%w), and settling it failed: %w: %w", c.Key, c.Fence, cause, store.ErrCommitUnknown, err)
	}
	switch {
	case found && r.state == 2 && r.fence == c.Fence && r.token == c.Token:
		return true, nil
	case found && r.token == c.Token:
		return false, fmt.Errorf("sqllock: complete-tx %q fence %d: the commit failed (%w); it did not land, and the claim is released", c.Key, c.Fence, cause)
	}
	// Another claim holds the record, or it is gone: the commit may have
	// landed and the record then outlived its ttl (unlikely within the
	// settle), or c's lease lapsed and another caller took the key.
	return false, fmt.Errorf("sqllock: complete-tx %q fence %d: the commit's outcome is unknown (%w), and the record has moved on to another claim since: %w", c.Key, c.Fence, cause, store.ErrCommitUnknown)
}

// errCommitRefused marks a failed commit that is not retried.
var errCommitRefused = errors.New("sqllock: the commit failed")

// isSQLite reports whether err carries an SQLite result code.
func isSQLite(err error) bool {
	var lite interface{ Code() int }
	return errors.As(err, &lite)
}

// retryTx reports whether a CompleteTx attempt that failed with err is
// run again, body included: a serialization failure or a deadlock, which
// rolled the transaction back, or a busy SQLite database.
func retryTx(err error) bool {
	if errors.Is(err, errCommitRefused) {
		return false
	}
	var pg interface{ SQLState() string }
	if errors.As(err, &pg) {
		s := pg.SQLState()
		return s == "40001" || s == "40P01"
	}
	var lite interface{ Code() int }
	if errors.As(err, &lite) {
		switch lite.Code() & 0xff {
		case 5, 6: // SQLITE_BUSY, SQLITE_LOCKED
			return true
		}
		return false
	}
	return mysqlRetryTx.MatchString(err.Error())
}

// mysqlRetryTx matches go-sql-driver/mysql's rendering of a deadlock
// (1213, which rolls the transaction back) and MariaDB's "record has
// changed since last read" (1020, under innodb_snapshot_isolation).
var mysqlRetryTx = regexp.MustCompile(`(^|: )Error (1213|1020)\b`)
