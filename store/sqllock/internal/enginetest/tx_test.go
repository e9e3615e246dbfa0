package enginetest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// rebind turns the ? placeholders of q into PostgreSQL's $1, $2, ...
func rebind(e engine, q string) string {
	if e.name != "postgres" {
		return q
	}
	var sb strings.Builder
	n := 0
	for _, r := range q {
		if r == '?' {
			n++
			fmt.Fprintf(&sb, "$%d", n)
			continue
		}
		sb.WriteRune(r)
	}
	return sb.String()
}

// sink is a table of the caller's own rows beside the backend's: each
// write adds a row carrying an id, never overwrites one, so a second
// commit of the same work shows as two rows.
type sink struct {
	e          engine
	db         *sql.DB
	table      string
	ins, count string
}

func newSink(t testing.TB, e engine, db *sql.DB) sink {
	t.Helper()
	table := fmt.Sprintf("u_%016x", rand.Uint64())
	if _, err := db.Exec("CREATE TABLE " + table + " (id VARCHAR(200) NOT NULL, n INTEGER NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return sink{e: e, db: db, table: table,
		ins:   rebind(e, "INSERT INTO "+table+" (id, n) VALUES (?, 1)"),
		count: rebind(e, "SELECT COUNT(*) FROM "+table+" WHERE id = ?"),
	}
}

// write adds, in tx, one row carrying id.
func (s sink) write(ctx context.Context, tx *sql.Tx, id string) error {
	_, err := tx.ExecContext(ctx, s.ins, id)
	return err
}

// read counts, in tx, the rows carrying id; on PostgreSQL and MySQL it
// locks them (SELECT ... FOR UPDATE), as a body that reads before it
// writes would.
func (s sink) read(ctx context.Context, tx *sql.Tx, id string) (int, error) {
	q := "SELECT id FROM " + s.table + " WHERE id = ?"
	if s.e.name != "sqlite" {
		q += " FOR UPDATE"
	}
	rows, err := tx.QueryContext(ctx, rebind(s.e, q), id)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		n++
	}
	return n, rows.Err()
}

// rows counts the committed rows carrying id, outside any transaction.
func (s sink) rows(t testing.TB, id string) int {
	t.Helper()
	var n int
	if err := s.db.QueryRowContext(context.Background(), s.count, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// mustWin claims key on b and fails t unless it won.
func mustWin(t testing.TB, b *sqllock.Backend, key string, lease time.Duration) store.Claim {
	t.Helper()
	r, err := b.Claim(context.Background(), key, lease)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim %q: %v %v, want won", key, r.Outcome, err)
	}
	return r.Claim
}

// outcome claims key on b and returns the outcome, failing t on an error.
func outcome(t testing.TB, b *sqllock.Backend, key string) store.Result {
	t.Helper()
	r, err := b.Claim(context.Background(), key, time.Minute)
	if err != nil {
		t.Fatalf("claim %q: %v", key, err)
	}
	return r
}

// dbNow is the engine's now, in Unix milliseconds, by its own clock.
func dbNow(t testing.TB, e engine, db *sql.DB) int64 {
	t.Helper()
	var now int64
	if err := db.QueryRow("SELECT " + e.sql().Now).Scan(&now); err != nil {
		t.Fatal(err)
	}
	return now
}

// record reads key's row as the tests look at it.
func record(t testing.TB, e engine, db *sql.DB, b *sqllock.Backend, key string) (state, fence, expires int64, token string, fp sql.NullString) {
	t.Helper()
	q := rebind(e, "SELECT state, fence, expires_at_ms, token, fingerprint FROM "+tableOf(b)+" WHERE idem_key = ?")
	if err := db.QueryRow(q, []byte(key)).Scan(&state, &fence, &expires, &token, &fp); err != nil {
		t.Fatal(err)
	}
	return
}

// The body's writes and the Done mark commit together; the mark is the one
// CompleteFingerprint writes (state 2, expires-at the database's now plus
// the ttl, the fingerprint stamped with the fence); a second CompleteTx of
// the same claim runs its body, commits nothing and answers false.
func TestCompleteTxCommitsTheWritesAndTheMarkTogether(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		const ttl = time.Hour
		db, b := e.fresh(t, nil, sqllock.WithTTL(ttl))
		s := newSink(t, e, db)
		ctx := t.Context()
		c := mustWin(t, b, "k", time.Minute)
		calls := 0
		body := func(ctx context.Context, tx *sql.Tx) error {
			calls++
			return s.write(ctx, tx, "k")
		}
		before := dbNow(t, e, db)
		ok, err := b.CompleteTx(ctx, c, "fp-1", body)
		after := dbNow(t, e, db)
		if !ok || err != nil {
			t.Fatalf("CompleteTx: %v %v, want true", ok, err)
		}
		if n := s.rows(t, "k"); n != 1 {
			t.Fatalf("%d rows after the commit, want 1", n)
		}
		state, fence, expires, token, fp := record(t, e, db, b, "k")
		if state != 2 || fence != c.Fence || token != c.Token || fp.String != fmt.Sprint(c.Fence, ":fp-1") {
			t.Errorf("record: state %d fence %d token %q fingerprint %v; want done, the claim's fence and token, %d:fp-1", state, fence, token, fp, c.Fence)
		}
		if expires < before+ttl.Milliseconds() || expires > after+ttl.Milliseconds() {
			t.Errorf("expires at %d, want the database's now plus the ttl: in [%d, %d]", expires, before+ttl.Milliseconds(), after+ttl.Milliseconds())
		}
		if r := outcome(t, b, "k"); r.Outcome != store.AlreadyDone || r.Fingerprint != "fp-1" {
			t.Fatalf("claim after: %v fingerprint %q, want already done with fp-1", r.Outcome, r.Fingerprint)
		}

		ok, err = b.CompleteTx(ctx, c, "fp-2", body)
		if ok || err != nil {
			t.Fatalf("second CompleteTx of the same claim: %v %v, want false", ok, err)
		}
		if calls != 2 {
			t.Errorf("body ran %d times, want 2", calls)
		}
		if n := s.rows(t, "k"); n != 1 {
			t.Fatalf("%d rows after the second CompleteTx, want 1 (its writes rolled back)", n)
		}
		if r := outcome(t, b, "k"); r.Fingerprint != "fp-1" {
			t.Errorf("fingerprint %q after the second CompleteTx, want fp-1 kept", r.Fingerprint)
		}

		// No fingerprint stores none.
		c2 := mustWin(t, b, "k2", time.Minute)
		if ok, err := b.CompleteTx(ctx, c2, "", func(context.Context, *sql.Tx) error { return nil }); !ok || err != nil {
			t.Fatal(ok, err)
		}
		if _, _, _, _, fp := record(t, e, db, b, "k2"); fp.Valid {
			t.Errorf("fingerprint %v stored for none", fp)
		}
	})
}

// A holder whose claim was replaced (its lease lapsed and another caller
// took the key) or released cannot commit: false, and its writes are
// absent; the successor is unaffected and completes.
func TestCompleteTxOfASupersededHolderIsRefused(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil)
		s := newSink(t, e, db)
		ctx := t.Context()
		old := mustWin(t, b, "k", time.Minute)
		expireNow(t, db, e, b, "k")
		succ := mustWin(t, b, "k", time.Minute)
		if succ.Fence != old.Fence+1 {
			t.Fatalf("successor fence %d, want %d", succ.Fence, old.Fence+1)
		}
		ok, err := b.CompleteTx(ctx, old, "", func(ctx context.Context, tx *sql.Tx) error { return s.write(ctx, tx, "old") })
		if ok || err != nil {
			t.Fatalf("the superseded holder: %v %v, want false", ok, err)
		}
		if n := s.rows(t, "old"); n != 0 {
			t.Fatalf("the superseded holder's writes: %d rows, want none", n)
		}
		if r := outcome(t, b, "k"); r.Outcome != store.HeldByOther {
			t.Fatalf("after the refused commit: %v, want the successor's claim held", r.Outcome)
		}
		if ok, err := b.CompleteTx(ctx, succ, "", func(ctx context.Context, tx *sql.Tx) error { return s.write(ctx, tx, "new") }); !ok || err != nil {
			t.Fatalf("the successor: %v %v, want true", ok, err)
		}
		if n := s.rows(t, "new"); n != 1 {
			t.Fatalf("the successor's writes: %d rows, want 1", n)
		}

		released := mustWin(t, b, "r", time.Minute)
		if err := b.Release(ctx, released); err != nil {
			t.Fatal(err)
		}
		if ok, err := b.CompleteTx(ctx, released, "", func(ctx context.Context, tx *sql.Tx) error { return s.write(ctx, tx, "released") }); ok || err != nil {
			t.Fatalf("a released claim: %v %v, want false", ok, err)
		}
		if n := s.rows(t, "released"); n != 0 {
			t.Fatalf("a released claim's writes: %d rows, want none", n)
		}
	})
}

// A reclaim that commits while the transaction is open, after body read
// c's record in it (which fixes a REPEATABLE READ snapshot showing c's
// claim), still fences the holder out: the conditional UPDATE reads the
// latest committed row (PostgreSQL at READ COMMITTED: each statement's
// own snapshot; MySQL: a locking read), or fails the transaction, which is
// then retried and finds the key replaced (PostgreSQL at REPEATABLE READ
// and SERIALIZABLE: 40001; MariaDB with innodb_snapshot_isolation: 1020).
// Either way: false, no writes, and the reclaimer's record untouched.
// (On SQLite no reclaim can commit during the body: the transaction holds
// the write lock from its start, TestCompleteTxSQLiteTakesTheWriteLockWhenItBegins.)
func TestCompleteTxSeesAReclaimCommittedDuringTheBody(t *testing.T) {
	type variant struct {
		name      string
		e         engine
		dsn       string // appended to the DSN
		opts      []sqllock.Option
		wantCalls int
	}
	variants := []variant{
		{"postgres", postgres, "", nil, 1},
		{"postgres/repeatable-read", postgres, "", []sqllock.Option{sqllock.WithTxOptions(sql.TxOptions{Isolation: sql.LevelRepeatableRead})}, 2},
		{"postgres/serializable", postgres, "", []sqllock.Option{sqllock.WithTxOptions(sql.TxOptions{Isolation: sql.LevelSerializable})}, 2},
		{"mysql", mariadb, "", nil, 1},
		{"mysql/snapshot-isolation", mariadb, "innodb_snapshot_isolation=ON", nil, 2},
	}
	for _, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			e := v.e
			dsn := e.dsn(t)
			if v.dsn != "" {
				sep := "?"
				if strings.Contains(dsn, "?") {
					sep = "&"
				}
				dsn += sep + v.dsn
			}
			db := e.open(t, dsn, nil)
			b := e.backend(t, db, v.opts...)
			s := newSink(t, e, db)
			ctx := t.Context()
			old := mustWin(t, b, "k", time.Minute)
			read := rebind(e, "SELECT token FROM "+tableOf(b)+" WHERE idem_key = ?")
			var succ store.Claim
			calls := 0
			ok, err := b.CompleteTx(ctx, old, "", func(ctx context.Context, tx *sql.Tx) error {
				calls++
				var token string
				if err := tx.QueryRowContext(ctx, read, []byte("k")).Scan(&token); err != nil {
					return err
				}
				if calls == 1 {
					if token != old.Token {
						return fmt.Errorf("the transaction's first read saw token %q, want the holder's", token)
					}
					expireNow(t, db, e, b, "k")
					succ = mustWin(t, b, "k", time.Minute)
				}
				return s.write(ctx, tx, "old")
			})
			t.Logf("CompleteTx: %v %v after %d body calls", ok, err, calls)
			if ok || err != nil {
				t.Fatalf("CompleteTx of the replaced holder: %v %v, want false", ok, err)
			}
			if calls != v.wantCalls {
				t.Errorf("body ran %d times, want %d", calls, v.wantCalls)
			}
			if n := s.rows(t, "old"); n != 0 {
				t.Fatalf("the replaced holder's writes: %d rows, want none", n)
			}
			if state, fence, _, token, _ := record(t, e, db, b, "k"); state != 1 || fence != succ.Fence || token != succ.Token {
				t.Fatalf("record: state %d fence %d; want the successor's claim (fence %d)", state, fence, succ.Fence)
			}
		})
	}
}

// lockWaits counts the sessions running an UPDATE of table that waits for
// a lock: on PostgreSQL, by its wait event; on MariaDB (whose
// information_schema.innodb_trx does not list the waiting transaction
// here), by the processlist: a session still "Updating" the table while
// the only other transaction on it holds the row lock is waiting for it.
func lockWaits(t testing.TB, e engine, db *sql.DB, table string) int {
	t.Helper()
	q := "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1"
	if e.name == "mysql" {
		q = "SELECT COUNT(*) FROM information_schema.processlist WHERE state = 'Updating' AND info LIKE ?"
	}
	var n int
	if err := db.QueryRow(q, "UPDATE %"+table+"%").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A reclaim still in flight when the conditional UPDATE runs holds the
// record's row lock: the UPDATE waits for it and then decides on the row
// as the reclaim left it. Committed: PostgreSQL re-evaluates the WHERE on
// the new row version (EvalPlanQual) and MySQL's locking read sees it:
// false, no writes. Rolled back: the UPDATE proceeds on the holder's row:
// true.
func TestCompleteTxWaitingOnAReclaimInFlightDecidesOnItsOutcome(t *testing.T) {
	for _, e := range networked {
		for _, reclaim := range []string{"commits", "rolls-back"} {
			t.Run(e.name+"/"+reclaim, func(t *testing.T) {
				db, b := e.fresh(t, nil)
				s := newSink(t, e, db)
				ctx := t.Context()
				old := mustWin(t, b, "k", time.Minute)
				rtx, err := db.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				defer rtx.Rollback()
				upd := rebind(e, "UPDATE "+tableOf(b)+" SET fence = fence + 1, token = 'reclaimer' WHERE idem_key = ?")
				if _, err := rtx.ExecContext(ctx, upd, []byte("k")); err != nil {
					t.Fatal(err)
				}
				type answer struct {
					ok  bool
					err error
				}
				got := make(chan answer, 1)
				go func() {
					ok, err := b.CompleteTx(ctx, old, "", func(ctx context.Context, tx *sql.Tx) error { return s.write(ctx, tx, "old") })
					got <- answer{ok, err}
				}()
				for lockWaits(t, e, db, tableOf(b)) == 0 {
					select {
					case a := <-got:
						t.Fatalf("CompleteTx returned %v %v without waiting for the reclaim's row lock", a.ok, a.err)
					case <-time.After(5 * time.Millisecond):
					}
				}
				if reclaim == "commits" {
					err = rtx.Commit()
				} else {
					err = rtx.Rollback()
				}
				if err != nil {
					t.Fatal(err)
				}
				a := <-got
				want := reclaim == "rolls-back"
				if a.ok != want || a.err != nil {
					t.Fatalf("CompleteTx after the reclaim %s: %v %v, want %v", reclaim, a.ok, a.err, want)
				}
				wantRows := 0
				if want {
					wantRows = 1
				}
				if n := s.rows(t, "old"); n != wantRows {
					t.Fatalf("%d rows, want %d", n, wantRows)
				}
			})
		}
	}
}

// A body error rolls everything back: no writes, no mark; the error wraps
// body's; the claim stays held, and can be released and claimed again.
func TestCompleteTxBodyErrorLeavesNoWritesAndNoMark(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil)
		s := newSink(t, e, db)
		ctx := t.Context()
		c := mustWin(t, b, "k", time.Minute)
		failed := &bodyError{"the body failed"}
		calls := 0
		ok, err := b.CompleteTx(ctx, c, "fp", func(ctx context.Context, tx *sql.Tx) error {
			calls++
			if err := s.write(ctx, tx, "k"); err != nil {
				return err
			}
			return fmt.Errorf("wrapped: %w", failed)
		})
		var be *bodyError
		if ok || !errors.Is(err, failed) || !errors.As(err, &be) {
			t.Fatalf("CompleteTx: %v %v, want an error wrapping the body's", ok, err)
		}
		if calls != 1 {
			t.Errorf("body ran %d times, want 1", calls)
		}
		if n := s.rows(t, "k"); n != 0 {
			t.Fatalf("%d rows after a body error, want none", n)
		}
		if r := outcome(t, b, "k"); r.Outcome != store.HeldByOther {
			t.Fatalf("after the body error: %v, want still held", r.Outcome)
		}
		if err := b.Release(ctx, c); err != nil {
			t.Fatal(err)
		}
		if r := outcome(t, b, "k"); r.Outcome != store.Won || r.Claim.Fence != c.Fence+2 {
			t.Fatalf("after the release: %v fence %d, want won with fence %d", r.Outcome, r.Claim.Fence, c.Fence+2)
		}
	})
}

type bodyError struct{ s string }

func (e *bodyError) Error() string { return e.s }

// liteBusy is an error carrying SQLite's result code SQLITE_BUSY, as
// modernc.org/sqlite's errors do.
type liteBusy struct{}

func (liteBusy) Error() string { return "database is locked (5) (SQLITE_BUSY)" }
func (liteBusy) Code() int     { return 5 }

// retryError is an error which, returned by body, makes CompleteTx run
// the transaction again: the engine's serialization failure or deadlock.
func retryError(e engine) error {
	switch e.name {
	case "postgres":
		return &pgconn.PgError{Severity: "ERROR", Code: "40001", Message: "could not serialize access due to concurrent update"}
	case "mysql":
		return &mysql.MySQLError{Number: 1213, Message: "Deadlock found when trying to get lock; try restarting transaction"}
	}
	return liteBusy{}
}

// A transaction that fails with a serialization failure or a deadlock is
// run again, body included, with a fresh transaction: only the writes of
// the one that commits exist. Retries are bounded by WithRetries, and
// other errors (a broken connection) are not retried.
func TestCompleteTxRetriedTransactionCommitsTheWritesOnce(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil, sqllock.WithRetries(2))
		s := newSink(t, e, db)
		ctx := t.Context()
		retry := retryError(e)

		c := mustWin(t, b, "once", time.Minute)
		var txs []*sql.Tx
		ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error {
			txs = append(txs, tx)
			if err := s.write(ctx, tx, "once"); err != nil {
				return err
			}
			if len(txs) == 1 {
				return fmt.Errorf("wrapped: %w", retry)
			}
			return nil
		})
		if !ok || err != nil {
			t.Fatalf("CompleteTx: %v %v, want true", ok, err)
		}
		if len(txs) != 2 || txs[0] == txs[1] {
			t.Fatalf("body ran %d times, want twice, with a fresh transaction", len(txs))
		}
		if n := s.rows(t, "once"); n != 1 {
			t.Fatalf("%d rows, want the committing attempt's one", n)
		}

		c = mustWin(t, b, "always", time.Minute)
		calls := 0
		ok, err = b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error {
			calls++
			if err := s.write(ctx, tx, "always"); err != nil {
				return err
			}
			return retry
		})
		if ok || !errors.Is(err, retry) {
			t.Fatalf("CompleteTx failing every attempt: %v %v, want an error wrapping the last", ok, err)
		}
		if calls != 3 {
			t.Errorf("body ran %d times, want 3 (WithRetries(2))", calls)
		}
		if n := s.rows(t, "always"); n != 0 {
			t.Fatalf("%d rows, want none", n)
		}

		c = mustWin(t, b, "broken", time.Minute)
		calls = 0
		ok, err = b.CompleteTx(ctx, c, "", func(context.Context, *sql.Tx) error {
			calls++
			return io.ErrUnexpectedEOF
		})
		if ok || !errors.Is(err, io.ErrUnexpectedEOF) || calls != 1 {
			t.Fatalf("a body failing with a broken connection: %v %v after %d calls, want its error after 1", ok, err, calls)
		}
	})
}

// A real deadlock between two CompleteTx bodies that lock two rows in
// opposite orders: the engine picks a victim, whose transaction is run
// again; both commit, each once.
func TestCompleteTxDeadlockedBodyIsRetried(t *testing.T) {
	eachEngine(t, networked, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil)
		ctx := t.Context()
		table := fmt.Sprintf("d_%016x", rand.Uint64())
		if _, err := db.Exec("CREATE TABLE " + table + " (id INTEGER PRIMARY KEY, v INTEGER NOT NULL)"); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec("INSERT INTO " + table + " (id, v) VALUES (1, 0), (2, 0)"); err != nil {
			t.Fatal(err)
		}
		bump := rebind(e, "UPDATE "+table+" SET v = v + 1 WHERE id = ?")
		first := [2]chan struct{}{make(chan struct{}), make(chan struct{})}
		var calls [2]atomic.Int32
		body := func(i int) func(context.Context, *sql.Tx) error {
			return func(ctx context.Context, tx *sql.Tx) error {
				n := calls[i].Add(1)
				if _, err := tx.ExecContext(ctx, bump, i+1); err != nil {
					return err
				}
				if n == 1 {
					close(first[i])
					<-first[1-i] // both hold their first row
				}
				_, err := tx.ExecContext(ctx, bump, 2-i)
				return err
			}
		}
		var wg sync.WaitGroup
		var errs [2]error
		var oks [2]bool
		for i := range 2 {
			c := mustWin(t, b, fmt.Sprint("k", i), time.Minute)
			wg.Go(func() { oks[i], errs[i] = b.CompleteTx(ctx, c, "", body(i)) })
		}
		wg.Wait()
		t.Logf("body calls %d and %d", calls[0].Load(), calls[1].Load())
		for i := range 2 {
			if !oks[i] || errs[i] != nil {
				t.Fatalf("CompleteTx %d: %v %v, want true", i, oks[i], errs[i])
			}
		}
		if total := calls[0].Load() + calls[1].Load(); total != 3 {
			t.Errorf("%d body calls, want 3 (one victim retried once)", total)
		}
		for id := 1; id <= 2; id++ {
			var v int
			if err := db.QueryRow(rebind(e, "SELECT v FROM "+table+" WHERE id = ?"), id).Scan(&v); err != nil || v != 2 {
				t.Fatalf("row %d: v = %d (%v), want 2 (one committed bump per transaction)", id, v, err)
			}
		}
	})
}

// While body runs, the transaction holds no lock on the record: a
// concurrent Claim of the key answers HeldByOther during the body, and
// the body then commits.
func TestCompleteTxConcurrentClaimDuringTheBodyIsHeldByOther(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil)
		s := newSink(t, e, db)
		ctx := t.Context()
		c := mustWin(t, b, "k", time.Minute)
		ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error {
			if e.name == "sqlite" {
				// SQLite: the transaction holds the database's write lock
				// from its start (TestCompleteTxSQLiteTakesTheWriteLockWhenItBegins),
				// and a Claim waits for the commit
				// (TestCompleteTxSQLiteClaimWaitsForTheBodysWriteLock).
				var n int
				return tx.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+s.table).Scan(&n)
			}
			if err := s.write(ctx, tx, "k"); err != nil {
				return err
			}
			got := make(chan store.Result, 1)
			go func() {
				r, err := b.Claim(ctx, "k", time.Minute)
				if err != nil {
					r.Outcome = 0
				}
				got <- r
			}()
			select {
			case r := <-got:
				if r.Outcome != store.HeldByOther {
					return fmt.Errorf("a Claim during the body answered %v, want HeldByOther", r.Outcome)
				}
			case <-time.After(30 * time.Second):
				return errors.New("a Claim during the body had not answered after 30s: blocked by the transaction")
			}
			return nil
		})
		if !ok || err != nil {
			t.Fatalf("CompleteTx: %v %v", ok, err)
		}
		if e.name == "sqlite" {
			return
		}
		if n := s.rows(t, "k"); n != 1 {
			t.Fatalf("%d rows, want 1", n)
		}
	})
}

// SQLite: CompleteTx takes the database's write lock when its transaction
// begins, as BEGIN IMMEDIATE would. A write from another connection while
// the body runs, although the body has only read, waits for the commit
// (with no busy timeout, it fails at once with SQLITE_BUSY): no reclaim of
// the key, and no renewal of its lease (WithHeartbeat), can commit between
// the body's snapshot and the mark, so none can make the mark's first
// write fail with SQLITE_BUSY_SNAPSHOT. The body runs once, and commits.
// (Before, a body that had only read held no lock: the write committed,
// and every attempt of a body that outlasted a heartbeat failed.)
func TestCompleteTxSQLiteTakesTheWriteLockWhenItBegins(t *testing.T) {
	dsn := sqliteDSN(t)
	db := sqliteEngine.open(t, dsn, nil)
	b := sqliteEngine.backend(t, db)
	s := newSink(t, sqliteEngine, db)
	other := sqliteEngine.open(t, strings.Replace(dsn, "busy_timeout(20000)", "busy_timeout(0)", 1), nil)
	ctx := t.Context()
	c := mustWin(t, b, "k", time.Minute)
	renew := rebind(sqliteEngine, "UPDATE "+tableOf(b)+" SET lease_expiry_ms = lease_expiry_ms + 1 WHERE idem_key = ?")
	calls := 0
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error {
		calls++
		var n int
		if err := tx.QueryRowContext(ctx, s.count, "k").Scan(&n); err != nil {
			return err
		}
		_, werr := other.ExecContext(ctx, renew, []byte("k"))
		var lite interface{ Code() int }
		if !errors.As(werr, &lite) || lite.Code()&0xff != 5 {
			return fmt.Errorf("a write from another connection during a body that has only read: %v, want SQLITE_BUSY (the write lock held since the transaction began)", werr)
		}
		return s.write(ctx, tx, "k")
	})
	if !ok || err != nil || calls != 1 {
		t.Fatalf("CompleteTx: %v %v after %d body calls, want true after 1", ok, err, calls)
	}
	if n := s.rows(t, "k"); n != 1 {
		t.Fatalf("%d rows, want 1", n)
	}
	if r := outcome(t, b, "k"); r.Outcome != store.AlreadyDone {
		t.Fatalf("after: %v, want already done", r.Outcome)
	}
}

// SQLite has one writer per database: a Claim sent while a CompleteTx
// body that has written is still running waits for the database's write
// lock until the transaction commits, and then answers AlreadyDone, not a
// prompt HeldByOther. With no busy timeout it fails with SQLITE_BUSY
// instead. (A body that has only read holds it too: CompleteTx takes it
// when the transaction begins,
// TestCompleteTxSQLiteTakesTheWriteLockWhenItBegins.) The waits are
// logged: the measurement behind CompleteTx's doc.
func TestCompleteTxSQLiteClaimWaitsForTheBodysWriteLock(t *testing.T) {
	const hold = 300 * time.Millisecond // how long the body goes on after its write
	for _, busy := range []string{"20000", "0"} {
		t.Run("busy_timeout="+busy, func(t *testing.T) {
			dsn := sqliteDSN(t)
			db := sqliteEngine.open(t, dsn, nil)
			b := sqliteEngine.backend(t, db)
			s := newSink(t, sqliteEngine, db)
			cc := &counter{}
			claimer, err := sqllock.New(sqliteEngine.open(t, strings.Replace(dsn, "busy_timeout(20000)", "busy_timeout("+busy+")", 1), cc), sqllock.SQLite, sqllock.WithTable(tableOf(b)))
			if err != nil {
				t.Fatal(err)
			}
			ctx := t.Context()
			c := mustWin(t, b, "k", time.Minute)
			type answer struct {
				r    store.Result
				err  error
				took time.Duration
			}
			got := make(chan answer, 1)
			sent := make(chan struct{})
			var once sync.Once
			hook := func(q string) {
				if strings.Contains(q, "ON CONFLICT") {
					once.Do(func() { close(sent) })
				}
			}
			cc.beforeQuery.Store(&hook)
			var bodyEnd time.Time
			ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error {
				if err := s.write(ctx, tx, "k"); err != nil {
					return err
				}
				go func() {
					start := time.Now()
					r, err := claimer.Claim(ctx, "k", time.Minute)
					got <- answer{r, err, time.Since(start)}
				}()
				<-sent // the Claim's upsert is on its way to SQLite
				if busy == "0" {
					a := <-got
					got <- a
				} else {
					time.Sleep(hold)
				}
				bodyEnd = time.Now()
				return nil
			})
			if !ok || err != nil {
				t.Fatalf("CompleteTx: %v %v", ok, err)
			}
			a := <-got
			t.Logf("busy_timeout=%s: a Claim sent during the body answered %v (%v) after %v; the body went on %v after the Claim was sent, and the Claim answered %v after the body ended",
				busy, a.r.Outcome, a.err, a.took.Round(time.Millisecond), hold, time.Since(bodyEnd).Round(time.Millisecond))
			if busy == "0" {
				var lite interface{ Code() int }
				if !errors.As(a.err, &lite) || lite.Code()&0xff != 5 {
					t.Fatalf("with no busy timeout: %v %v, want SQLITE_BUSY", a.r.Outcome, a.err)
				}
				return
			}
			if a.err != nil || a.r.Outcome != store.AlreadyDone {
				t.Fatalf("a Claim sent during the body: %v %v, want AlreadyDone (it waited for the commit)", a.r.Outcome, a.err)
			}
		})
	}
}

// A commit whose reply is lost is settled before CompleteTx returns:
// true iff the writes exist. landed: the commit reached the database and
// its reply was dropped: true, one row. cut: the connection was cut as
// the commit was sent: not committed, an error, no rows, and the claim can
// be released and taken again. unsettled: the reply was dropped and no
// new connection can be made to settle it: an error wrapping
// store.ErrCommitUnknown (the commit had landed: one row).
func TestCompleteTxLostCommitReplyIsSettled(t *testing.T) {
	for _, e := range networked {
		for _, fault := range []string{"landed", "cut", "unsettled"} {
			t.Run(e.name+"/"+fault, func(t *testing.T) {
				dsn := e.dsn(t)
				host := serverAddr(e, dsn)
				proxy := testsvc.NewDropProxy(t, host)
				c := &counter{}
				db := e.open(t, strings.Replace(dsn, host, proxy.Addr(), 1), c)
				db.SetMaxOpenConns(1)
				b := e.backend(t, db, sqllock.WithRetries(1))
				direct := e.open(t, dsn, nil)
				other, err := sqllock.New(direct, e.dialect, sqllock.WithTable(tableOf(b)))
				if err != nil {
					t.Fatal(err)
				}
				s := newSink(t, e, direct)
				ctx := t.Context()
				// Prepare the statements on the one connection.
				warm := mustWin(t, b, "warm-up", time.Minute)
				if ok, err := b.CompleteTx(ctx, warm, "", func(ctx context.Context, tx *sql.Tx) error { return s.write(ctx, tx, "warm-up") }); !ok || err != nil {
					t.Fatal(ok, err)
				}
				mine := mustWin(t, b, "k", time.Minute)

				refused := errors.New("no new connections")
				var armed atomic.Bool
				armed.Store(true)
				before := func() {
					if !armed.CompareAndSwap(true, false) {
						return
					}
					switch fault {
					case "landed":
						proxy.LoseNextReply()
					case "cut":
						proxy.CutConnections()
					case "unsettled":
						proxy.LoseNextReply()
						fail := func(context.Context) error { return refused }
						c.onConnect.Store(&fail)
					}
				}
				c.beforeCommit.Store(&before)
				ok, err := b.CompleteTx(ctx, mine, "", func(ctx context.Context, tx *sql.Tx) error { return s.write(ctx, tx, "k") })
				c.onConnect.Store(nil)
				t.Logf("CompleteTx: %v %v (dropped %d replies, cut %d connections)", ok, err, proxy.Dropped.Load(), proxy.Cuts.Load())
				if armed.Load() {
					t.Fatal("the commit was never sent")
				}
				switch fault {
				case "landed":
					if proxy.Dropped.Load() != 1 {
						t.Fatalf("dropped %d replies, want the commit's", proxy.Dropped.Load())
					}
					if !ok || err != nil {
						t.Fatalf("a commit that landed, its reply lost: %v %v, want true", ok, err)
					}
					if n := s.rows(t, "k"); n != 1 {
						t.Fatalf("%d rows, want 1", n)
					}
					if r := outcome(t, other, "k"); r.Outcome != store.AlreadyDone {
						t.Fatalf("after: %v, want already done", r.Outcome)
					}
				case "cut":
					if ok || err == nil || errors.Is(err, store.ErrCommitUnknown) {
						t.Fatalf("a commit cut before it was sent: %v %v, want an error (not committed)", ok, err)
					}
					if n := s.rows(t, "k"); n != 0 {
						t.Fatalf("%d rows, want none", n)
					}
					if err := b.Release(ctx, mine); err != nil {
						t.Fatal(err)
					}
					if r := outcome(t, other, "k"); r.Outcome != store.Won {
						t.Fatalf("after the release: %v, want won", r.Outcome)
					}
				case "unsettled":
					if ok || !errors.Is(err, store.ErrCommitUnknown) || !errors.Is(err, refused) {
						t.Fatalf("a lost commit that cannot be settled: %v %v, want an error wrapping ErrCommitUnknown and the connection's", ok, err)
					}
					if n := s.rows(t, "k"); n != 1 {
						t.Fatalf("%d rows, want 1 (the commit landed)", n)
					}
					if r := outcome(t, other, "k"); r.Outcome != store.AlreadyDone {
						t.Fatalf("after: %v, want already done", r.Outcome)
					}
				}
			})
		}
	}
}

// A process that dies between the body's last write and the commit leaves
// neither the writes nor the mark: ctx cancelled after the write (the
// transaction is rolled back), or the connection cut after the write (the
// server aborts it). The claim stays held until released or its lease
// lapses.
func TestCompleteTxCrashBeforeTheCommitLeavesNeither(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil)
		s := newSink(t, e, db)
		c := mustWin(t, b, "cancel", time.Minute)
		ctx, cancel := context.WithCancel(t.Context())
		ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error {
			if err := s.write(ctx, tx, "cancel"); err != nil {
				return err
			}
			cancel()
			return nil
		})
		if ok || !errors.Is(err, context.Canceled) {
			t.Fatalf("ctx cancelled after the body's write: %v %v, want an error wrapping context.Canceled", ok, err)
		}
		if n := s.rows(t, "cancel"); n != 0 {
			t.Fatalf("%d rows, want none", n)
		}
		if r := outcome(t, b, "cancel"); r.Outcome != store.HeldByOther {
			t.Fatalf("after: %v, want still held", r.Outcome)
		}
	})
	eachEngine(t, networked, func(t *testing.T, e engine) {
		dsn := e.dsn(t)
		host := serverAddr(e, dsn)
		proxy := testsvc.NewDropProxy(t, host)
		db := e.open(t, strings.Replace(dsn, host, proxy.Addr(), 1), nil)
		b := e.backend(t, db)
		direct := e.open(t, dsn, nil)
		other, err := sqllock.New(direct, e.dialect, sqllock.WithTable(tableOf(b)))
		if err != nil {
			t.Fatal(err)
		}
		s := newSink(t, e, direct)
		ctx := t.Context()
		c := mustWin(t, b, "cut", time.Minute)
		ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error {
			if err := s.write(ctx, tx, "cut"); err != nil {
				return err
			}
			proxy.CutConnections()
			return nil
		})
		if ok || err == nil || errors.Is(err, store.ErrCommitUnknown) {
			t.Fatalf("the connection cut after the body's write: %v %v, want an error (not committed)", ok, err)
		}
		if n := s.rows(t, "cut"); n != 0 {
			t.Fatalf("%d rows, want none", n)
		}
		if r := outcome(t, other, "cut"); r.Outcome != store.HeldByOther {
			t.Fatalf("after: %v, want still held", r.Outcome)
		}
	})
}

// TestTxContract runs the storetest suite's CompleteTx cases on every
// engine, with the body's rows in a table of their own beside the
// backend's. The networked engines get a DropProxy per case, as in
// TestContract; Count reads past it. Read is the body's own read of its
// rows (FOR UPDATE on PostgreSQL and MariaDB); EndTx ends the transaction
// the engine's way (endTx): PostgreSQL a failing statement (SELECT 1/0),
// which aborts it; MariaDB an explicit ROLLBACK statement, which leaves
// the session where a deadlock's victim is (a real deadlock needs a
// second transaction and the right timing); SQLite a write interrupted
// because its own context ended.
//
// SQLite gets a database file per case (cases run in parallel, and SQLite
// has one writer per database) opened with a busy timeout of one second:
// a Claim sent while a body that has written is still running waits for
// the write lock (TestCompleteTxSQLiteClaimWaitsForTheBodysWriteLock), and
// with the 20 s timeout of the other tests it would wait out the suite's
// 30 s bound (four attempts of 20 s). With one second it answers an
// SQLITE_BUSY error within about four, which the suite accepts as not
// blocked (an error, never HeldByOther: see CompleteTx's doc).
func TestTxContract(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		shared := e.dsn(t)
		storetest.RunTx(t, func(t *testing.T) storetest.TxHarness[*sql.Tx] {
			const ttl = 2 * time.Second
			h := storetest.TxHarness[*sql.Tx]{Harness: storetest.Harness{TTL: ttl, Step: 200 * time.Millisecond}, Retry: retryError(e)}
			dsn := shared
			if e.name == "sqlite" {
				dsn = strings.Replace(sqliteDSN(t), "busy_timeout(20000)", "busy_timeout(1000)", 1)
			}
			direct := e.open(t, dsn, nil)
			db := direct
			if host := serverAddr(e, dsn); host != "" {
				proxy := testsvc.NewDropProxy(t, host)
				db = e.open(t, strings.Replace(dsn, host, proxy.Addr(), 1), nil)
				h.Faults = proxy
			}
			b := e.backend(t, db, sqllock.WithTTL(ttl))
			h.Backend = b
			s := newSink(t, e, direct)
			h.Write = s.write
			h.Read = s.read
			h.EndTx = endTx(e, tableOf(b))
			h.Count = func(ctx context.Context, id string) (int, error) {
				var n int
				err := direct.QueryRowContext(ctx, s.count, id).Scan(&n)
				return n, err
			}
			return h
		})
	})
}

// On MariaDB CompleteTx bounds the commit's wait with the session's
// idle_write_transaction_timeout (sqllock.CommitIdleTimeout) and puts the
// session's own value back before the connection returns to the pool,
// whatever the outcome: committed, fenced out, a body error, a
// transaction the server ended under the body. With a pool of one
// connection, the value read after each is the one set before.
func TestCompleteTxPutsMariaDBsIdleBoundBack(t *testing.T) {
	db, b := mariadb.fresh(t, nil)
	db.SetMaxOpenConns(1)
	s := newSink(t, mariadb, db)
	ctx := t.Context()
	if _, err := db.ExecContext(ctx, "SET SESSION idle_write_transaction_timeout = 3600"); err != nil {
		t.Fatal(err)
	}
	bound := func() (during int) {
		var v int
		if err := db.QueryRowContext(ctx, "SELECT @@session.idle_write_transaction_timeout").Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	if v := bound(); v != 3600 {
		t.Fatalf("the session's value: %d, want 3600", v)
	}
	cases := map[string]func(c store.Claim) (bool, error){
		"committed": func(c store.Claim) (bool, error) {
			return b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error { return s.write(ctx, tx, c.Key) })
		},
		"fenced-out": func(c store.Claim) (bool, error) {
			c.Fence++
			return b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error { return s.write(ctx, tx, c.Key) })
		},
		"body-error": func(c store.Claim) (bool, error) {
			return b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error { return errors.New("no") })
		},
		"tx-ended-under-the-body": func(c store.Claim) (bool, error) {
			return b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error {
				_, err := tx.ExecContext(ctx, "ROLLBACK") // as a deadlock would
				return err
			})
		},
	}
	for name, run := range cases {
		c := mustWin(t, b, name, time.Minute)
		ok, err := run(c)
		t.Logf("%s: %v %v", name, ok, err)
		if name == "tx-ended-under-the-body" && (ok || err == nil) {
			t.Fatalf("%s: %v %v, want an error (the transaction was gone)", name, ok, err)
		}
		if v := bound(); v != 3600 {
			t.Fatalf("after %s: idle_write_transaction_timeout %d, want the session's 3600 back", name, v)
		}
	}
}
