package enginetest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// endTxWays returns, per engine, the ways the engine itself ends a
// transaction under the body (each returns the failing statement's
// error), for a backend whose table is table:
//
//   - PostgreSQL: any failed statement aborts the transaction (SELECT 1/0).
//   - MariaDB: a deadlock's victim is rolled back whole and the session
//     goes on outside any transaction; an explicit ROLLBACK statement on
//     tx does the same to the session (a real deadlock victim needs a
//     second transaction and the right timing: attack_tx_test.go has one).
//   - SQLite: a writing statement interrupted because its own context
//     ended rolls the whole transaction back (modernc.org/sqlite
//     interrupts it); so does INSERT OR ROLLBACK hitting a constraint.
func endTxWays(e engine, table string) map[string]func(ctx context.Context, tx *sql.Tx) error {
	switch e.name {
	case "postgres":
		return map[string]func(ctx context.Context, tx *sql.Tx) error{
			"failed-statement": func(ctx context.Context, tx *sql.Tx) error {
				_, err := tx.ExecContext(ctx, "SELECT 1/0")
				return err
			},
			// A body's own ROLLBACK statement: the session goes on outside
			// any transaction.
			"rollback-statement": func(ctx context.Context, tx *sql.Tx) error {
				_, err := tx.ExecContext(ctx, "ROLLBACK")
				return err
			},
		}
	case "mysql":
		return map[string]func(ctx context.Context, tx *sql.Tx) error{
			"rollback-as-a-deadlock-would": func(ctx context.Context, tx *sql.Tx) error {
				_, err := tx.ExecContext(ctx, "ROLLBACK")
				return err
			},
		}
	}
	return map[string]func(ctx context.Context, tx *sql.Tx) error{
		"statement-cut-short-by-its-context": liteInterrupt,
		"insert-or-rollback": func(ctx context.Context, tx *sql.Tx) error {
			// The claim's own record is in the table: copying it breaks
			// the primary key.
			_, err := tx.ExecContext(ctx, `INSERT OR ROLLBACK INTO "`+table+`" SELECT * FROM "`+table+`" LIMIT 1`)
			if err == nil {
				return errors.New("INSERT OR ROLLBACK of a copied record succeeded")
			}
			return err
		},
	}
}

// liteInterrupt runs, in tx, a write that would take minutes on a
// context that ends 10ms in: modernc.org/sqlite interrupts it, and SQLite
// rolls the whole transaction back. On a loaded machine the context may
// end before the statement is sent (database/sql then sends nothing): the
// scratch table, created in tx, is still there, and it tries again.
func liteInterrupt(ctx context.Context, tx *sql.Tx) error {
	if _, err := tx.ExecContext(ctx, "CREATE TEMP TABLE IF NOT EXISTS endtx_scratch (x INTEGER)"); err != nil {
		return err
	}
	for {
		sctx, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
		_, err := tx.ExecContext(sctx, `WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 2000000000)
INSERT INTO temp.endtx_scratch SELECT x FROM c`)
		cancel()
		if err == nil {
			return errors.New("the interrupted write completed")
		}
		var n int
		if ctx.Err() != nil || tx.QueryRowContext(ctx, "SELECT COUNT(*) FROM temp.endtx_scratch").Scan(&n) != nil {
			return err // the transaction, and the table with it, is gone
		}
	}
}

// endTx is the harness's and the storm's way for e to end tx under the
// body: the first of endTxWays (the context interrupt on SQLite).
func endTx(e engine, table string) func(ctx context.Context, tx *sql.Tx) error {
	if e.name == "sqlite" {
		return liteInterrupt
	}
	for _, f := range endTxWays(e, table) {
		return f
	}
	return nil
}

// When the engine ends the transaction under the body (a statement the
// engine fails in a way that ends the whole transaction) and the body
// swallows that error and returns nil, CompleteTx marks nothing: it
// returns an error (nothing committed, so the delivery is nacked), the
// record stays Claimed by c with none of the body's rows, and a
// redelivery runs the body and commits once. On SQLite, before the fix,
// the mark's UPDATE ran outside any transaction and committed on its own:
// the record Done, no rows, the redelivery acked as a duplicate.
func TestCompleteTxWhenTheEngineEndsTheTransactionUnderTheBodyMarksNothing(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil)
		s := newSink(t, e, db)
		for name, end := range endTxWays(e, tableOf(b)) {
			t.Run(name, func(t *testing.T) {
				ctx := t.Context()
				key := fmt.Sprintf("%s-%016x", name, rand.Uint64())
				c := mustWin(t, b, key, time.Minute)
				var swallowed error
				ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error {
					if err := s.write(ctx, tx, key); err != nil {
						return err
					}
					swallowed = end(ctx, tx)
					return nil
				})
				t.Logf("the body swallowed: %v; CompleteTx: %v %v", swallowed, ok, err)
				if swallowed == nil && !strings.Contains(name, "rollback") {
					t.Fatal("the statement that ends the transaction did not fail")
				}
				if ok || err == nil {
					t.Fatalf("CompleteTx: %v %v, want an error (the transaction was gone, nothing committed)", ok, err)
				}
				if !strings.Contains(err.Error(), "nothing committed") {
					t.Errorf("the error does not say that nothing committed: %v", err)
				}
				if n := s.rows(t, key); n != 0 {
					t.Fatalf("%d rows of the body, want 0", n)
				}
				if state, fence, _, token, _ := record(t, e, db, b, key); state != 1 || fence != c.Fence || token != c.Token {
					t.Fatalf("record: state %d fence %d, want still claimed by c (state 1, fence %d)", state, fence, c.Fence)
				}
				// The delivery nacks and its claim is released; the redelivery
				// runs the body and commits once.
				if err := b.Release(ctx, c); err != nil {
					t.Fatal(err)
				}
				calls := 0
				if err := idempotency.LockTx(ctx, b, key, func(ctx context.Context, tx *sql.Tx) error {
					calls++
					return s.write(ctx, tx, key)
				}); err != nil || calls != 1 {
					t.Fatalf("redelivery: %v, body ran %d times, want nil and 1", err, calls)
				}
				if n := s.rows(t, key); n != 1 {
					t.Fatalf("%d rows after the redelivery, want 1", n)
				}
			})
		}
	})
}

// A body statement that commits implicitly on MariaDB (DDL such as
// CREATE TABLE IF NOT EXISTS) commits the body's earlier writes without
// the Done mark, and the rest of the body autocommits. CompleteTx finds
// that out and marks the key done (the writes exist): a second delivery
// of the same key is a duplicate, and the effect exists once. Before the
// fix CompleteTx returned an error claiming the writes were rolled back,
// and every redelivery wrote them again.
func TestCompleteTxBodyThatCommitsImplicitlyOnMariaDBIsDoneOnce(t *testing.T) {
	db, b := mariadb.fresh(t, nil)
	s := newSink(t, mariadb, db)
	ddl := fmt.Sprintf("CREATE TABLE IF NOT EXISTS ddl_%016x (id INTEGER)", rand.Uint64())
	ctx := t.Context()
	calls := 0
	body := func(ctx context.Context, tx *sql.Tx) error {
		calls++
		if err := s.write(ctx, tx, "before"); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, ddl); err != nil {
			return err
		}
		return s.write(ctx, tx, "after")
	}
	for i := range 2 {
		err := idempotency.LockTx(ctx, b, "k", body)
		t.Logf("delivery %d: %v", i+1, err)
	}
	if n, m := s.rows(t, "before"), s.rows(t, "after"); n != 1 || m != 1 || calls != 1 {
		t.Fatalf("rows before/after the DDL: %d/%d, body ran %d times; want 1/1 and 1 (the second delivery a duplicate)", n, m, calls)
	}
	if r := outcome(t, b, "k"); r.Outcome != store.AlreadyDone {
		t.Fatalf("the key: %v, want already done", r.Outcome)
	}
	// Through CompleteTx: true, the key done.
	c := mustWin(t, b, "k2", time.Minute)
	ok, err := b.CompleteTx(ctx, c, "fp", body)
	if !ok || err != nil {
		t.Fatalf("CompleteTx of a body that committed implicitly: %v %v, want true (its writes exist, the key marked)", ok, err)
	}
	if state, _, _, _, fp := record(t, mariadb, db, b, "k2"); state != 2 || fp.String != fmt.Sprint(c.Fence, ":fp") {
		t.Fatalf("record: state %d fingerprint %v, want done with %d:fp", state, fp, c.Fence)
	}
}

// A MariaDB body whose transaction is rolled back under it (an explicit
// ROLLBACK, as a deadlock's victim is) and which returns nil: CompleteTx
// says the writes were rolled back, marks nothing, and the redelivery
// runs the body and commits it once.
func TestCompleteTxBodyRolledBackOnMariaDBSaysRolledBack(t *testing.T) {
	db, b := mariadb.fresh(t, nil)
	s := newSink(t, mariadb, db)
	ctx := t.Context()
	c := mustWin(t, b, "k", time.Minute)
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error {
		if err := s.write(ctx, tx, "k"); err != nil {
			return err
		}
		tx.ExecContext(ctx, "ROLLBACK")
		return nil
	})
	if ok || err == nil || !strings.Contains(err.Error(), "rolled back") || !strings.Contains(err.Error(), "nothing committed") {
		t.Fatalf("CompleteTx: %v %v, want an error saying the writes were rolled back and nothing committed", ok, err)
	}
	if state, _, _, _, _ := record(t, mariadb, db, b, "k"); state != 1 || s.rows(t, "k") != 0 {
		t.Fatalf("state %d, %d rows; want still claimed, none", state, s.rows(t, "k"))
	}
}

// New accepts, through WithTxOptions, exactly the isolation levels the
// engine has, and a CompleteTx at each of them commits; it refuses every
// other level with an error naming it. Before the fix New accepted
// sql.LevelSnapshot, LevelWriteCommitted and LevelLinearizable everywhere
// (and every level on SQLite): on PostgreSQL and MariaDB every delivery's
// begin then failed ("unsupported isolation"), on SQLite the transaction
// ran at its one level whatever was asked.
func TestNewRefusesAnIsolationLevelTheEngineDoesNotHave(t *testing.T) {
	all := []sql.IsolationLevel{sql.LevelDefault, sql.LevelReadUncommitted, sql.LevelReadCommitted, sql.LevelWriteCommitted,
		sql.LevelRepeatableRead, sql.LevelSnapshot, sql.LevelSerializable, sql.LevelLinearizable}
	has := map[string][]sql.IsolationLevel{
		"postgres": {sql.LevelDefault, sql.LevelReadUncommitted, sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable},
		"mysql":    {sql.LevelDefault, sql.LevelReadUncommitted, sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable},
		"sqlite":   {sql.LevelDefault, sql.LevelSerializable},
	}
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db := e.open(t, e.dsn(t), nil)
		s := newSink(t, e, db)
		for _, l := range all {
			_, err := sqllock.New(db, e.dialect, sqllock.WithTxOptions(sql.TxOptions{Isolation: l}))
			if !slices.Contains(has[e.name], l) {
				if err == nil || !strings.Contains(err.Error(), l.String()) {
					t.Errorf("New at %v: %v, want an error naming the level", l, err)
				}
				continue
			}
			if err != nil {
				t.Fatalf("New at %v: %v", l, err)
			}
			b := e.backend(t, db, sqllock.WithTxOptions(sql.TxOptions{Isolation: l}))
			key := "k-" + strings.ReplaceAll(l.String(), " ", "")
			c := mustWin(t, b, key, time.Minute)
			if ok, err := b.CompleteTx(t.Context(), c, "", func(ctx context.Context, tx *sql.Tx) error { return s.write(ctx, tx, key) }); !ok || err != nil {
				t.Errorf("CompleteTx at %v: %v %v, want true", l, ok, err)
			}
		}
	})
}

// logRecorder is a slog handler that keeps every record's level and
// message, with its attributes.
type logRecorder struct {
	mu    sync.Mutex
	lines []string
}

func (r *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *logRecorder) Handle(_ context.Context, rec slog.Record) error {
	line := rec.Level.String() + " " + rec.Message
	rec.Attrs(func(a slog.Attr) bool { line += " " + a.String(); return true })
	r.mu.Lock()
	r.lines = append(r.lines, line)
	r.mu.Unlock()
	return nil
}
func (r *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *logRecorder) WithGroup(string) slog.Handler      { return r }

// all returns the lines kept so far.
func (r *logRecorder) all() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.lines)
}

// On a pool of one connection (db.SetMaxOpenConns(1)) a LockTx under
// WithHeartbeat holds the only connection for the body's transaction, so
// no renewal can get one while the body runs. The renewals fail at once
// with an error that says so (the heartbeat logs it, and tries again),
// rather than each one waiting for the connection: the body's commit is
// not held up, the delivery commits once, and nothing deadlocks. Before
// the fix each renewal waited, silently, for the transaction's end.
func TestLockTxWithHeartbeatOnAPoolOfOneConnectionCommitsOnceAndSaysRenewalsCannotRun(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		dsn := e.dsn(t)
		db := e.open(t, dsn, nil)
		db.SetMaxOpenConns(1)
		b := e.backend(t, db)
		s := newSink(t, e, e.open(t, dsn, nil))
		logs := &logRecorder{}
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		key := fmt.Sprintf("k-%016x", rand.Uint64())
		calls := 0
		err := idempotency.LockTx(ctx, b, key, func(ctx context.Context, tx *sql.Tx) error {
			calls++
			if err := s.write(ctx, tx, key); err != nil {
				return err
			}
			time.Sleep(time.Second) // several heartbeats
			return nil
		}, idempotency.WithHeartbeat(idempotency.MinHeartbeat), idempotency.WithLease(5*time.Second),
			idempotency.WithLogger(slog.New(logs)))
		if err != nil || calls != 1 || s.rows(t, key) != 1 {
			t.Fatalf("LockTx: %v, body ran %d times, %d rows; want nil, 1, 1", err, calls, s.rows(t, key))
		}
		said := 0
		for _, l := range logs.all() {
			t.Log(l)
			if strings.Contains(l, "lease renewal failed") && strings.Contains(l, "pool") {
				said++
			}
		}
		if said == 0 {
			t.Fatal("no renewal said that the pool's only connection was held by the body's transaction")
		}
		if st := db.Stats(); st.InUse != 0 {
			t.Fatalf("%d connections in use after LockTx", st.InUse)
		}
	})
}

// A body that sends a COMMIT statement on tx: the writes before it
// commit. On SQLite the marker committed with them, and the mark, which
// requires it, commits on its own right after: true, the key done, the
// writes once. On PostgreSQL the setting that holds the marker ends with
// the transaction: nothing is marked and CompleteTx fails (the writes
// exist without the mark). On MariaDB it is an implicit commit: true.
func TestCompleteTxBodyThatSendsCommit(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil)
		s := newSink(t, e, db)
		c := mustWin(t, b, "k", time.Minute)
		ok, err := b.CompleteTx(t.Context(), c, "", func(ctx context.Context, tx *sql.Tx) error {
			if err := s.write(ctx, tx, "k"); err != nil {
				return err
			}
			_, err := tx.ExecContext(ctx, "COMMIT")
			return err
		})
		t.Logf("CompleteTx: %v %v", ok, err)
		state, _, _, _, _ := record(t, e, db, b, "k")
		if n := s.rows(t, "k"); n != 1 {
			t.Fatalf("%d rows, want 1 (the body's COMMIT)", n)
		}
		if e.name == "postgres" {
			if ok || err == nil || state != 1 {
				t.Fatalf("CompleteTx: %v %v, state %d; want an error and the record still claimed", ok, err, state)
			}
			return
		}
		if !ok || err != nil || state != 2 {
			t.Fatalf("CompleteTx: %v %v, state %d; want true and the key done", ok, err, state)
		}
	})
}

// A MariaDB body that commits implicitly and whose claim is then taken by
// another delivery: the writes before the DDL exist, the key is not
// marked for the lost claim, and the error says that the writes exist.
func TestCompleteTxBodyThatCommitsImplicitlyAndLosesItsClaimSaysTheWritesExist(t *testing.T) {
	db, b := mariadb.fresh(t, nil)
	s := newSink(t, mariadb, db)
	ddl := fmt.Sprintf("CREATE TABLE IF NOT EXISTS ddl_%016x (id INTEGER)", rand.Uint64())
	c := mustWin(t, b, "k", time.Minute)
	ok, err := b.CompleteTx(t.Context(), c, "", func(ctx context.Context, tx *sql.Tx) error {
		if err := s.write(ctx, tx, "k"); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, ddl); err != nil {
			return err
		}
		expireNow(t, db, mariadb, b, "k")
		mustWin(t, b, "k", time.Minute)
		return nil
	})
	if ok || err == nil || !strings.Contains(err.Error(), "writes exist") {
		t.Fatalf("CompleteTx: %v %v, want an error saying that the writes exist", ok, err)
	}
	if state, fence, _, _, _ := record(t, mariadb, db, b, "k"); state != 1 || fence != c.Fence+1 || s.rows(t, "k") != 1 {
		t.Fatalf("state %d fence %d, %d rows; want the other delivery's claim (fence %d) and the write", state, fence, s.rows(t, "k"), c.Fence+1)
	}
}

// A MariaDB body that commits implicitly and then fails: CompleteTx
// returns its error, says that the writes before the DDL exist, and does
// not run the transaction again, even for an error it would retry (a
// deadlock): a new attempt would write them a second time. Before the fix
// the deadlock's attempt ran the body again (two rows).
func TestCompleteTxBodyThatCommitsImplicitlyAndFailsIsNotRunAgain(t *testing.T) {
	db, b := mariadb.fresh(t, nil)
	s := newSink(t, mariadb, db)
	ddl := fmt.Sprintf("CREATE TABLE IF NOT EXISTS ddl_%016x (id INTEGER)", rand.Uint64())
	c := mustWin(t, b, "k", time.Minute)
	calls := 0
	deadlock := retryError(mariadb)
	ok, err := b.CompleteTx(t.Context(), c, "", func(ctx context.Context, tx *sql.Tx) error {
		calls++
		if err := s.write(ctx, tx, "k"); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, ddl); err != nil {
			return err
		}
		return deadlock
	})
	if ok || err == nil || !errors.Is(err, deadlock) || !strings.Contains(err.Error(), "committed implicitly") {
		t.Fatalf("CompleteTx: %v %v, want the body's error, saying the transaction committed implicitly", ok, err)
	}
	if calls != 1 || s.rows(t, "k") != 1 {
		t.Fatalf("body ran %d times, %d rows; want 1 and 1", calls, s.rows(t, "k"))
	}
}
