package sqllock

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/internal/dialect"
)

var _ store.TxBackend[*sql.Tx] = (*Backend)(nil)

// WithTxOptions sets the options of the transactions CompleteTx begins,
// for example sql.TxOptions{Isolation: sql.LevelSerializable}. Without it
// CompleteTx begins them with nil options: the driver's and the session's
// defaults (READ COMMITTED on PostgreSQL, REPEATABLE READ on MySQL and
// MariaDB, a deferred transaction on SQLite, which CompleteTx then turns
// into a writing one at once). ReadOnly makes New fail, as the Done mark
// is a write, and so does an isolation level the engine does not have
// (which its driver would refuse at every transaction's begin, or run at
// another level): PostgreSQL and MySQL take sql.LevelReadUncommitted,
// LevelReadCommitted, LevelRepeatableRead and LevelSerializable, SQLite
// only LevelSerializable (all its transactions are); LevelSnapshot,
// LevelWriteCommitted and LevelLinearizable none. The other verbs run
// single statements and do not use them.
//
// Snapshot isolation and WithHeartbeat do not mix: at REPEATABLE READ or
// SERIALIZABLE on PostgreSQL, and on MariaDB with
// innodb_snapshot_isolation=ON (the default from MariaDB 11.6.2) at
// REPEATABLE READ or above, a lease renewal that commits while body runs
// (after body's first read fixed the snapshot) makes the Done mark's
// UPDATE fail, in every attempt of a body longer than one heartbeat
// period, and CompleteTx then fails with an error wrapping
// ErrSnapshotConflict. Use sql.LevelReadCommitted for such bodies (its
// renewals do not conflict), or keep body shorter than the heartbeat
// period.
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
// the UPDATE, rolls the transaction back and runs the whole of it again,
// body included, with a fresh transaction, within WithRetries' budget and
// backoff. Only the writes of the transaction that commits exist; whatever
// body does outside the transaction (calls to other services, messages
// sent) may happen once per call. Return such an error from body (wrapped
// or not) to have the transaction retried. Other errors, a broken
// connection among them, are not retried. When the attempts end with the
// UPDATE refused because c's record changed after the transaction's
// snapshot (40001 at REPEATABLE READ or SERIALIZABLE, 1020), the error
// wraps ErrSnapshotConflict, which says why: under WithHeartbeat, a body
// longer than the heartbeat period meets a renewal of c's lease in every
// attempt (see WithTxOptions).
//
// Body must return every error a statement on tx returned (wrapped or
// not), and must leave the transaction open. Some statements and
// failures end the whole transaction under body, and the statements
// after them run outside it: PostgreSQL aborts it on any failed
// statement; MySQL and MariaDB roll it back on a deadlock (1213) or an
// explicit ROLLBACK, and commit it implicitly on DDL (CREATE TABLE IF NOT
// EXISTS, ALTER TABLE, ...), LOCK TABLES or COMMIT; SQLite rolls it back
// when a writing statement is interrupted because its context ended, on
// INSERT OR ROLLBACK hitting a constraint, SQLITE_FULL or SQLITE_IOERR.
// CompleteTx never lets the Done mark commit on its own after such an
// end, whatever body returns: at the transaction's start it writes a
// marker, a number no earlier transaction of the process used, that a
// rollback takes away (PostgreSQL: the transaction-local setting
// sqllock.tx_marker; MySQL, MariaDB and SQLite: a row in the
// connection's TEMP table sqllock_tx_marker, which the first CompleteTx
// on a connection creates; on MySQL and MariaDB that needs the CREATE
// TEMPORARY TABLES privilege, the table is made in the schema of a
// schema-qualified WithTable, and no permanent table there may bear its
// name), and the mark's UPDATE requires it (on
// MariaDB also @@in_transaction = 1; MySQL 8, which lacks it, is checked
// with SET TRANSACTION READ WRITE, refused inside a transaction). After
// body:
//
//   - Rolled back (or aborted): nothing is marked, and the error says
//     that body's writes were rolled back and nothing committed.
//   - Committed before its end (MySQL and MariaDB: an implicit commit,
//     told from a rollback by the marker, which a commit keeps): body's
//     writes before that statement committed with it, and each one after
//     it committed on its own. The key is marked done now, with the plain
//     fenced mark outside any transaction, a warning is logged
//     (WithLogger), and CompleteTx answers true: a redelivery is a
//     duplicate rather than writing them again. A crash between the
//     implicit commit and that mark leaves the writes without the mark
//     (the redelivery writes them again), so keep such statements out of
//     body. If the claim was lost by then, nothing is marked and the
//     error says that the writes exist. On SQLite a COMMIT statement of
//     body leaves the marker committed, and the mark commits on its own
//     right after: true, with the warning.
//   - Body returned an error after its transaction committed implicitly
//     (MySQL, MariaDB): the error wraps body's and says so (the writes
//     before that statement exist, the record stays Claimed by c), and
//     the transaction is not run again, even for a deadlock.
//   - A ROLLBACK or COMMIT statement of body on PostgreSQL: nothing is
//     marked, an error (after a COMMIT, the writes before it exist
//     without the mark).
//
// A body that calls tx.Commit or tx.Rollback itself makes the next
// statement fail with sql.ErrTxDone, and CompleteTx returns an error (if
// body committed, its writes exist without the mark).
//
// ctx governs the transaction: a ctx that ends before the commit rolls it
// back (database/sql does), and a ctx that ends during the commit ends
// CompleteTx's wait for its reply (the commit is then settled, as a lost
// reply). On MySQL and MariaDB the COMMIT is sent as a statement on tx
// (go-sql-driver/mysql sends database/sql's Commit without a context, and
// would wait for its reply for ever), and tx is then ended with a
// Rollback that finds nothing to roll back.
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
//   - From the UPDATE on, the transaction waits for its commit at most
//     CommitIdleTimeout on the server (PostgreSQL, MariaDB): a client
//     frozen before its commit arrived, or cut off by a network that keeps
//     the server's side open, cannot hold c's row lock for longer, and a
//     duplicate's Claim waiting on it then gets its answer. MySQL 8 has no
//     such bound (see CommitIdleTimeout).
//   - SQLite has one writer per database, and CompleteTx takes its write
//     lock when the transaction begins (its first statement is a write
//     that changes nothing, as BEGIN IMMEDIATE would): no other write can
//     commit between the transaction's snapshot and its mark, so none
//     conflicts with it, and a transactional body holds SQLite's write
//     lock for its whole run, reads only or not. Every other write waits
//     for it (up to the busy timeout, then SQLITE_BUSY, which the verbs
//     retry WithRetries times): a concurrent Claim of any key, this one
//     included, waits for the commit and then answers AlreadyDone (or,
//     after false or an error, HeldByOther or Won), rather than a prompt
//     HeldByOther; so does a WithHeartbeat renewal of c's lease, which
//     then finds the record done (or, after waiting out the busy timeout,
//     fails, and is tried again at the next heartbeat).
//   - Body should end well within c's lease: after the lease lapses
//     another caller may take the key, and the UPDATE then finds it
//     replaced (false, body's writes rolled back). Extend the lease for
//     longer work (at READ COMMITTED: see WithTxOptions).
//   - A long transaction has the engine's costs: PostgreSQL keeps the
//     rows body wrote locked and holds back vacuum's horizon
//     (idle_in_transaction_session_timeout and statement_timeout may end
//     it); InnoDB keeps body's row locks (others wait up to
//     innodb_lock_wait_timeout, 50 s by default, then fail with 1205) and
//     its undo history; SQLite blocks every other writer. Keep body to
//     the writes that must commit with the mark.
//
// Round trips, besides body's statements: PostgreSQL: begin, the
// marker, the UPDATE, the commit. SQLite (in process): begin, the write
// that takes the lock, the marker, the UPDATE (compiled on each call: it
// names the connection's TEMP table), the commit. MariaDB: begin, the
// marker, setting the commit's bound, the UPDATE, the COMMIT, the
// ROLLBACK that ends tx, putting the bound back (and, once per Backend,
// a SELECT @@in_transaction that tells MariaDB from MySQL). MySQL 8:
// begin, the marker, the check that the transaction is open, the UPDATE,
// the COMMIT, the ROLLBACK. A connection's first CompleteTx on MySQL,
// MariaDB or SQLite also creates the marker table (two more).
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
	attempts := 0
	err := b.backoff.Do(ctx, func(int) error {
		attempts++
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
		if errors.Is(err, errRecordChanged) {
			return false, fmt.Errorf("sqllock: complete-tx %q fence %d: %w (%d attempts, the last one's error: %w)", c.Key, c.Fence, ErrSnapshotConflict, attempts, err)
		}
		return false, fmt.Errorf("sqllock: complete-tx %q fence %d: %w", c.Key, c.Fence, b.explain(err))
	}
	return done, nil
}

// ErrSnapshotConflict is wrapped by CompleteTx's error when its attempts
// ended with the Done mark's UPDATE refused because c's record changed
// after the transaction's snapshot was taken (PostgreSQL at REPEATABLE
// READ or SERIALIZABLE: SQLSTATE 40001; MariaDB with
// innodb_snapshot_isolation: error 1020). Under WithHeartbeat this is
// what a body longer than one heartbeat period meets on every attempt:
// the renewal updates the record while the body runs. Nothing committed.
var ErrSnapshotConflict = errors.New("sqllock: the claim's record changed during the body under snapshot isolation " +
	"(a lease renewal by WithHeartbeat, or another writer, updated it after the transaction's snapshot was taken), " +
	"so the Done mark's UPDATE was refused in every attempt and nothing committed; " +
	"run CompleteTx at READ COMMITTED (WithTxOptions; on MariaDB, innodb_snapshot_isolation=OFF), " +
	"or keep the body shorter than the heartbeat period")

// errRecordChanged marks a Done mark's UPDATE refused by a snapshot
// conflict (see ErrSnapshotConflict).
var errRecordChanged = errors.New("sqllock: the record changed since the transaction's snapshot")

// errTxRolledBack ends an attempt whose transaction the engine rolled
// back while body ran, body having gone on without returning the
// statement's error.
var errTxRolledBack = errors.New("sqllock: the transaction was rolled back under the body " +
	"(by a statement that ends the whole transaction: a deadlock, an explicit ROLLBACK, on SQLite a statement " +
	"interrupted because its context ended, INSERT OR ROLLBACK, a full disk or an I/O error), whose error body did not return; " +
	"body's writes in it are gone, nothing committed, and the Done mark was not written (the delivery is nacked and runs again)")

// errTxAborted wraps PostgreSQL's refusal of the mark in a transaction a
// failed statement of body aborted.
var errTxAborted = errors.New("sqllock: the transaction was aborted under the body by a failed statement whose error body did not return; " +
	"nothing committed, and the Done mark was not written (the delivery is nacked and runs again)")

// PostgreSQL's marker: a setting local to the transaction.
const (
	pgWriteMarker = "SELECT set_config('" + dialect.PgTxMarker + "', $1, true)"
	pgReadMarker  = "SELECT current_setting('" + dialect.PgTxMarker + "', true) IS NOT DISTINCT FROM $1"
)

// errTxEndedByStatement ends a PostgreSQL attempt whose transaction a
// ROLLBACK or COMMIT statement of body ended.
var errTxEndedByStatement = errors.New("sqllock: the transaction was ended under the body by a ROLLBACK or COMMIT statement on tx, " +
	"and the Done mark was not written: after a ROLLBACK nothing committed (the delivery is nacked and runs again); " +
	"after a COMMIT the body's writes before it exist without the mark")

// pgAborted reports whether err is PostgreSQL's refusal of a statement in
// an aborted transaction (SQLSTATE 25P02).
func pgAborted(err error) bool {
	var pg interface{ SQLState() string }
	return errors.As(err, &pg) && pg.SQLState() == "25P02"
}

// txMarkers numbers the transactions of CompleteTx in this process (see
// dialect.TxMarker): a connection's marker row, left by an earlier
// transaction, never holds the number of a later one. It starts at a
// random number, so that two processes' markers do not meet even in a
// table they would share (a permanent table of the marker's name, which
// the TEMP table's name then resolves to on MySQL).
var txMarkers atomic.Int64

func init() { txMarkers.Store(rand.Int64N(1 << 62)) }

// mysqlMarker is the MySQL dialect's statements on the TEMP marker table,
// named in the backend table's schema when WithTable names one (a
// connection with no default database then still finds it).
type mysqlMarker struct {
	create, write, mariaRead, mysqlRead, boundIdle string
}

// newMySQLMarker returns the marker statements of a backend on table.
func newMySQLMarker(table string) mysqlMarker {
	t := dialect.TxMarker
	if i := strings.LastIndexByte(table, '.'); i >= 0 {
		t = table[:i] + "." + t
	}
	return mysqlMarker{
		create: "CREATE TEMPORARY TABLE IF NOT EXISTS " + t + " (k INT NOT NULL PRIMARY KEY, n BIGINT NOT NULL) ENGINE=InnoDB",
		// write takes the number as a literal: without arguments
		// go-sql-driver/mysql sends one query, not a prepare, an execute
		// and a close.
		write:     "INSERT INTO " + t + " (k, n) VALUES (1, %d) ON DUPLICATE KEY UPDATE n = VALUES(n)",
		mariaRead: "SELECT @@in_transaction, COALESCE((SELECT n FROM " + t + " WHERE k = 1), 0)",
		mysqlRead: "SELECT 0, COALESCE((SELECT n FROM " + t + " WHERE k = 1), 0)",
		// boundIdle keeps the session's idle_write_transaction_timeout and
		// sets it to CommitIdleTimeout (whole seconds): a write
		// transaction idle for longer, its COMMIT not arriving, is ended
		// by the server. It also reads the transaction's marker into the
		// user variable @sqllock_tx_marker, which the mark requires.
		boundIdle: "SET @sqllock_idle_write_transaction_timeout = @@session.idle_write_transaction_timeout, " +
			"@@session.idle_write_transaction_timeout = " + strconv.Itoa(int(CommitIdleTimeout/time.Second)) + ", " +
			"@" + dialect.TxMarker + " = (SELECT n FROM " + t + " WHERE k = 1)",
	}
}

// The statements on the TEMP marker table.
var (
	liteCreateMarker = "CREATE TEMP TABLE IF NOT EXISTS " + dialect.TxMarker + " (k INTEGER PRIMARY KEY, n INTEGER NOT NULL)"
	liteWriteMarker  = "INSERT OR REPLACE INTO temp." + dialect.TxMarker + " (k, n) VALUES (1, ?)"
	liteReadMarker   = "SELECT 1, COALESCE((SELECT n FROM temp." + dialect.TxMarker + " WHERE k = 1), 0)"
)

// writeMarker writes marker into the connection's TEMP marker table,
// creating the table on the connection's first use.
func (b *Backend) writeMarker(ctx context.Context, tx *sql.Tx, marker int64) error {
	create, write, args := liteCreateMarker, liteWriteMarker, []any{marker}
	if b.d == MySQL {
		create, write, args = b.mk.create, fmt.Sprintf(b.mk.write, marker), nil
	}
	_, err := tx.ExecContext(ctx, write, args...)
	if err != nil && noSuchTable(err) {
		if _, err = tx.ExecContext(ctx, create); err == nil {
			_, err = tx.ExecContext(ctx, write, args...)
		}
	}
	return err
}

// noSuchTable reports whether err says that a table does not exist
// (SQLite's "no such table", MySQL's error 1146).
func noSuchTable(err error) bool {
	return strings.Contains(err.Error(), "no such table") || mysqlNoTable.MatchString(err.Error())
}

// mysqlNoTable matches go-sql-driver/mysql's rendering of error 1146.
var mysqlNoTable = regexp.MustCompile(`(^|: )Error 1146\b`)

// markerState reads, on tx's connection, whether the transaction that
// wrote marker is still open (its marker in place and, on MariaDB,
// @@in_transaction) and whether its marker committed (the transaction is
// over, and its marker outlived it: it committed). SQLite's and MySQL 8's
// reads cannot see an open transaction apart from a committed one: they
// are asked only where the caller knows which (SQLite has no implicit
// commit; MySQL 8's check said none is open).
func (b *Backend) markerState(ctx context.Context, tx *sql.Tx, marker int64) (open, committed bool, err error) {
	q := liteReadMarker
	if b.d == MySQL {
		q = b.mk.mariaRead
		if b.mysqlServer.Load() == serverMySQL {
			q = b.mk.mysqlRead
		}
	}
	var inTx, n int64
	if err := tx.QueryRowContext(ctx, q).Scan(&inTx, &n); err != nil {
		if noSuchTable(err) {
			return false, false, nil // created in a transaction rolled back since
		}
		return false, false, err
	}
	if n != marker {
		return false, false, nil
	}
	return inTx == 1, inTx != 1, nil
}

// txGone ends an attempt whose transaction is no longer open after body:
// the engine rolled it back (an error, nothing marked), or it committed
// implicitly (MySQL's DDL and LOCK TABLES, a COMMIT statement), in which
// case body's writes up to that point exist, those after it committed one
// by one, and the record is marked Done now with the plain conditional
// mark, outside any transaction, on tx's connection.
func (b *Backend) txGone(ctx context.Context, tx *sql.Tx, plain *sql.Stmt, c store.Claim, k []byte, stamped any, marker int64) (done, unsure bool, err error) {
	_, committed, err := b.markerState(ctx, tx, marker)
	if err != nil {
		return false, false, fmt.Errorf("the transaction is no longer open, and reading its marker failed: %w", err)
	}
	if !committed || plain == nil {
		return false, false, errTxRolledBack
	}
	res, err := tx.StmtContext(ctx, plain).ExecContext(ctx, millis(b.ttl), stamped, k, c.Fence, c.Token)
	var n int64
	if err == nil {
		n, err = res.RowsAffected()
	}
	switch {
	case err != nil:
		return false, false, fmt.Errorf("%w, and marking the key done after it failed: %w (a redelivery runs body again)", errImplicitCommit, err)
	case n != 1:
		return false, false, fmt.Errorf("%w, and the claim was no longer held when it was marked done after it: not marked (the claim's holder now decides the key)", errImplicitCommit)
	}
	b.warnImplicitCommit(ctx, c)
	return true, false, nil
}

// committedByBody ends an SQLite attempt whose mark matched and whose
// commit found no transaction: body committed it with a COMMIT statement,
// and the mark then committed on its own. It reads the record on conn to
// be sure.
func (b *Backend) committedByBody(ctx context.Context, conn *sql.Conn, c store.Claim, k []byte) (done, unsure bool, err error) {
	var r row
	if err := conn.QueryRowContext(ctx, b.q.Read, k).Scan(r.Dest()...); err != nil {
		return false, false, fmt.Errorf("the commit found no transaction, and reading the record failed: %w", err)
	}
	if r.State != 2 || r.Fence != c.Fence || r.Token != c.Token {
		return false, false, errTxRolledBack
	}
	b.warnImplicitCommit(ctx, c)
	return true, false, nil
}

// warnImplicitCommit logs that c's key was marked done after its body's
// transaction had committed before its end.
func (b *Backend) warnImplicitCommit(ctx context.Context, c store.Claim) {
	b.logger.WarnContext(ctx, "sqllock: complete-tx: the body's transaction committed before its end "+
		"(a statement that commits implicitly, such as CREATE TABLE, ALTER TABLE or LOCK TABLES on MySQL and MariaDB, or a COMMIT statement): "+
		"the writes before it committed then, those after it each committed on its own, and the key was marked done after them, "+
		"outside any transaction; keep such statements out of the body",
		"key", c.Key, "fence", c.Fence)
}

// errImplicitCommit says that body's transaction committed before its
// end, without the Done mark.
var errImplicitCommit = errors.New("sqllock: the body's transaction committed implicitly before its end " +
	"(a statement such as CREATE TABLE, LOCK TABLES or COMMIT): its writes exist without the Done mark")

// The servers behind the MySQL dialect, as CompleteTx finds out on its
// first call.
const (
	serverUnknown int32 = iota
	serverMariaDB       // has @@in_transaction and idle_write_transaction_timeout
	serverMySQL         // MySQL 8: has neither
)

// The MySQL dialect's session statements of CompleteTx.
const (
	// mariaInTx reads whether the session is in a transaction; MySQL 8
	// fails it with error 1193 (unknown system variable).
	mariaInTx = "SELECT @@in_transaction"
	// mariaRestoreIdle puts the kept value back.
	mariaRestoreIdle = "SET @@session.idle_write_transaction_timeout = @sqllock_idle_write_transaction_timeout"
	// mysqlStillInTx is MySQL 8's check that the session is still in a
	// transaction: SET TRANSACTION (without GLOBAL or SESSION) is refused
	// with error 1568 while a transaction is in progress. When none is, it
	// succeeds and makes the session's next transaction READ WRITE, the
	// default.
	mysqlStillInTx = "SET TRANSACTION READ WRITE"
)

// CommitIdleTimeout bounds, on the server, how long a transaction of
// CompleteTx stays open after its Done mark's UPDATE (which locks c's
// record) while its commit does not arrive: a client frozen, or cut off
// by a network that keeps the server's side of the connection open. When
// it ends, the server ends the session and rolls the transaction back,
// which frees the record's row lock: a duplicate's Claim waits at most
// this long on it, and then gets its answer (and the frozen caller's
// CompleteTx, settling, finds nothing committed). On PostgreSQL it is
// idle_in_transaction_session_timeout, set for the rest of the
// transaction only (set_config(..., true), as SET LOCAL) by the mark's
// UPDATE itself; on MariaDB it is the session's
// idle_write_transaction_timeout, set before the mark's UPDATE and put
// back after the transaction ends. MySQL 8 has no such setting: there a
// frozen client's transaction holds the row lock until the server drops
// the connection (wait_timeout, or TCP keepalive), and a duplicate's
// Claim waits innodb_lock_wait_timeout and then fails with error 1205.
// SQLite runs in the caller's process and needs none. The body's own
// statements are not bounded: the bound starts at the mark.
const CommitIdleTimeout = dialect.CommitIdleMillis * time.Millisecond

// server returns the server behind the MySQL dialect, finding it out on
// the first call.
func (b *Backend) server(ctx context.Context) (int32, error) {
	if s := b.mysqlServer.Load(); s != serverUnknown {
		return s, nil
	}
	var inTx int
	err := b.db.QueryRowContext(ctx, mariaInTx).Scan(&inTx)
	switch {
	case err == nil:
		b.mysqlServer.Store(serverMariaDB)
	case mysqlUnknownVariable.MatchString(err.Error()):
		b.mysqlServer.Store(serverMySQL)
	default:
		return serverUnknown, fmt.Errorf("finding out the server (%s): %w", mariaInTx, err)
	}
	return b.mysqlServer.Load(), nil
}

// mysqlUnknownVariable matches go-sql-driver/mysql's rendering of error
// 1193, "Unknown system variable".
var mysqlUnknownVariable = regexp.MustCompile(`(^|: )Error 1193\b`)

// mysqlInProgress matches go-sql-driver/mysql's rendering of error 1568,
// "Transaction characteristics can't be changed while a transaction is in
// progress".
var mysqlInProgress = regexp.MustCompile(`(^|: )Error 1568\b`)

// snapshotConflict reports whether err, from the Done mark's UPDATE, says
// that the record changed after the transaction's snapshot.
func snapshotConflict(err error) bool {
	var pg interface{ SQLState() string }
	if errors.As(err, &pg) {
		return pg.SQLState() == "40001"
	}
	var lite interface{ Code() int }
	if errors.As(err, &lite) {
		return lite.Code() == 517 // SQLITE_BUSY_SNAPSHOT
	}
	return mysqlChanged.MatchString(err.Error())
}

// mysqlChanged matches MariaDB's error 1020, "Record has changed since
// last read".
var mysqlChanged = regexp.MustCompile(`(^|: )Error 1020\b`)

// txEnded adds to err, returned by a statement on tx after body returned,
// that body must have ended tx itself.
func txEnded(ctx context.Context, what string, err error) error {
	if errors.Is(err, sql.ErrTxDone) && ctx.Err() == nil {
		return fmt.Errorf("%s: the transaction was ended (did body commit or roll back tx?): %w", what, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// completeTxOnce is one attempt of CompleteTx: a transaction, body, the
// UPDATE and the commit. unsure reports a commit that failed in a way
// that may have let it land (err is then the commit's error).
func (b *Backend) completeTxOnce(ctx context.Context, c store.Claim, k []byte, stamped any, body func(ctx context.Context, tx *sql.Tx) error) (done, unsure bool, err error) {
	// The statements are found and prepared on the pool before a
	// connection is taken for the transaction (a pool of one connection
	// has none to spare for them).
	server := serverUnknown
	markQ := b.q.CompleteTx
	if b.d == MySQL {
		if server, err = b.server(ctx); err != nil {
			return false, false, err
		}
		if server == serverMySQL {
			markQ = b.q.CompleteClaimed
		}
	}
	// SQLite's mark names the TEMP marker table, which exists only on
	// connections that have run a CompleteTx: it is prepared on the
	// transaction's own connection, not on the pool.
	var st *sql.Stmt
	if b.d != SQLite {
		if st, err = b.stmt(ctx, markQ); err != nil {
			return false, false, err
		}
	}
	// plain is the mark without the transaction's conditions, which marks
	// a key whose writes committed implicitly (MySQL, MariaDB).
	var plain *sql.Stmt
	if b.d == MySQL {
		if plain, err = b.stmt(ctx, b.q.CompleteClaimed); err != nil {
			return false, false, err
		}
	}
	var pgMarker *sql.Stmt
	if b.d == Postgres {
		if pgMarker, err = b.stmt(ctx, pgWriteMarker); err != nil {
			return false, false, err
		}
	}
	var lock *sql.Stmt
	if b.q.LockWrites != "" {
		if lock, err = b.stmt(ctx, b.q.LockWrites); err != nil {
			return false, false, err
		}
	}
	conn, err := b.db.Conn(ctx)
	if err != nil {
		return false, false, fmt.Errorf("connection: %w", err)
	}
	b.txConns.Add(1)
	defer b.txConns.Add(-1)
	// restore is set once MariaDB's idle_write_transaction_timeout has
	// been changed on conn: it is put back before conn goes back to the
	// pool, and conn is discarded if that fails.
	restore := false
	defer func() {
		if restore {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), SettleTimeout)
			if _, err := conn.ExecContext(rctx, mariaRestoreIdle); err != nil {
				conn.Raw(func(any) error { return driver.ErrBadConn })
			}
			cancel()
		}
		conn.Close()
	}()
	tx, err := conn.BeginTx(ctx, b.txOpts)
	if err != nil {
		return false, false, fmt.Errorf("begin: %w", err)
	}
	ended := false
	defer func() {
		if !ended {
			tx.Rollback()
		}
	}()
	if lock != nil {
		// SQLite: take the write lock now, as BEGIN IMMEDIATE would, so
		// that no other writer (a renewal of c's lease among them) can
		// commit after this transaction's snapshot and before its mark.
		if _, err := tx.StmtContext(ctx, lock).ExecContext(ctx); err != nil {
			return false, false, fmt.Errorf("taking the write lock: %w", err)
		}
	}
	// marker is this transaction's number in the TEMP marker table
	// (SQLite, MySQL): the mark requires it, and after the body it tells
	// a transaction still open from one the engine committed or rolled
	// back (see dialect.TxMarker).
	marker := txMarkers.Add(1)
	if pgMarker != nil {
		_, err = tx.StmtContext(ctx, pgMarker).ExecContext(ctx, strconv.FormatInt(marker, 10))
	} else {
		err = b.writeMarker(ctx, tx, marker)
	}
	if err != nil {
		return false, false, fmt.Errorf("writing the transaction's marker: %w", err)
	}
	if err := body(ctx, tx); err != nil {
		if b.d == MySQL && ctx.Err() == nil {
			// A statement of body may have committed the transaction
			// implicitly before the error: its writes before it exist,
			// and a new attempt would write them again.
			if _, committed, rerr := b.markerState(ctx, tx, marker); rerr == nil && committed {
				return false, false, fmt.Errorf("body: %w (%w; the record stays claimed, and the transaction is not run again)", err, errImplicitCommit)
			}
		}
		return false, false, fmt.Errorf("body: %w", err)
	}
	switch server {
	case serverMariaDB:
		if _, err := tx.ExecContext(ctx, b.mk.boundIdle); err != nil {
			return false, false, txEnded(ctx, "bounding the commit's wait", err)
		}
		restore = true
	case serverMySQL:
		_, err := tx.ExecContext(ctx, mysqlStillInTx)
		switch {
		case err == nil:
			return b.txGone(ctx, tx, plain, c, k, stamped, marker)
		case !mysqlInProgress.MatchString(err.Error()):
			return false, false, txEnded(ctx, "checking that the transaction is open", err)
		}
	}
	matched := false
	switch {
	case b.d == SQLite:
		var v any
		err = tx.QueryRowContext(ctx, b.q.CompleteTx, k, c.Fence, millis(b.ttl), c.Token, stamped, marker).Scan(&v)
		if errors.Is(err, sql.ErrNoRows) {
			err = nil
		} else {
			matched = err == nil
		}
	case b.q.Returning:
		var v any
		err = tx.StmtContext(ctx, st).QueryRowContext(ctx, k, c.Fence, millis(b.ttl), c.Token, stamped, strconv.FormatInt(marker, 10)).Scan(&v)
		if errors.Is(err, sql.ErrNoRows) {
			err = nil
		} else {
			matched = err == nil
		}
	default:
		args := []any{millis(b.ttl), stamped, k, c.Fence, c.Token}
		if server == serverMariaDB {
			args = append(args, marker)
		}
		var res sql.Result
		if res, err = tx.StmtContext(ctx, st).ExecContext(ctx, args...); err == nil {
			var n int64
			n, err = res.RowsAffected()
			matched = n == 1
		}
	}
	if err != nil {
		if b.d == SQLite && ctx.Err() == nil && !errors.Is(err, sql.ErrTxDone) {
			// The mark names the marker table, whose creation a rollback
			// under the body may have taken back with it.
			if open, _, rerr := b.markerState(ctx, tx, marker); rerr == nil && !open {
				return false, false, errTxRolledBack
			}
		}
		if snapshotConflict(err) {
			err = fmt.Errorf("%w: %w", errRecordChanged, err)
		}
		if pgAborted(err) {
			err = fmt.Errorf("%w: %w", errTxAborted, err)
		}
		return false, false, txEnded(ctx, "marking done", err)
	}
	if !matched {
		if b.d == Postgres {
			// The mark requires the transaction's marker: tell a
			// transaction a ROLLBACK or COMMIT statement ended from a claim
			// fenced out.
			var open bool
			if err := tx.QueryRowContext(ctx, pgReadMarker, strconv.FormatInt(marker, 10)).Scan(&open); err != nil {
				return false, false, fmt.Errorf("checking that the transaction is open: %w", err)
			}
			if !open {
				return false, false, errTxEndedByStatement
			}
		}
		if b.d == SQLite || server == serverMariaDB {
			// The mark requires the transaction's marker (and, on MariaDB,
			// @@in_transaction = 1): tell a transaction the engine ended
			// from a claim fenced out.
			open, _, err := b.markerState(ctx, tx, marker)
			if err != nil {
				return false, false, fmt.Errorf("checking that the transaction is open: %w", err)
			}
			if !open {
				return b.txGone(ctx, tx, plain, c, k, stamped, marker)
			}
		}
		return false, false, nil
	}
	if b.d == MySQL {
		return b.commitMySQL(ctx, tx, &ended)
	}
	ended = true
	if err := tx.Commit(); err != nil {
		if errors.Is(err, sql.ErrTxDone) {
			// database/sql rolled the transaction back (ctx ended) before
			// the commit was sent.
			return false, false, fmt.Errorf("commit: %w", err)
		}
		if mayHaveLanded(err) {
			return false, true, err
		}
		if isSQLite(err) && strings.Contains(err.Error(), "no transaction is active") {
			// The body committed tx itself (a COMMIT statement): the mark,
			// which requires the transaction's marker, matched the
			// committed one and committed on its own.
			return b.committedByBody(ctx, conn, c, k)
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

// commitMySQL commits tx on MySQL or MariaDB. go-sql-driver/mysql sends
// database/sql's Commit without a context, and waits for its reply for as
// long as the connection's readTimeout (none by default): a commit whose
// reply never comes would hold CompleteTx for ever, whatever ctx says. So
// the COMMIT is sent as a statement on tx, which the driver abandons
// (closing the connection) when ctx ends; database/sql's Tx is then ended
// with Rollback, a ROLLBACK that finds no transaction to roll back.
func (b *Backend) commitMySQL(ctx context.Context, tx *sql.Tx, ended *bool) (done, unsure bool, err error) {
	if err := ctx.Err(); err != nil {
		return false, false, fmt.Errorf("commit: %w", err) // not sent; the deferred Rollback ends tx
	}
	_, err = tx.ExecContext(ctx, "COMMIT")
	*ended = true
	tx.Rollback()
	if err == nil {
		return true, false, nil
	}
	if mayHaveLanded(err) {
		return false, true, err
	}
	return false, false, fmt.Errorf("commit: %w", err)
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
	case found && r.State == 2 && r.Fence == c.Fence && r.Token == c.Token:
		return true, nil
	case found && r.Token == c.Token:
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
	if errors.Is(err, errCommitRefused) || errors.Is(err, errImplicitCommit) {
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
