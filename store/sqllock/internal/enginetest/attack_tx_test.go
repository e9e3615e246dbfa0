package enginetest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// leaseOf reads key's lease expiry outside any transaction.
func leaseOf(t testing.TB, e engine, db *sql.DB, b *sqllock.Backend, key string) int64 {
	t.Helper()
	var ms int64
	q := rebind(e, "SELECT lease_expiry_ms FROM "+tableOf(b)+" WHERE idem_key = ?")
	if err := db.QueryRow(q, []byte(key)).Scan(&ms); err != nil {
		t.Fatal(err)
	}
	return ms
}

// A transactional body that outlasts one heartbeat period, under
// WithHeartbeat (the documented way to run work longer than the lease).
// The body reads (as most bodies do: a balance, a stock level) before it
// writes, which fixes its snapshot; the heartbeat then renews the lease,
// an UPDATE of the very record the transaction marks done at its end.
// Wherever the mark's UPDATE refuses a row changed since the snapshot
// (PostgreSQL at REPEATABLE READ or SERIALIZABLE, MariaDB with
// innodb_snapshot_isolation), each attempt fails, is retried with the body
// again, and meets the next renewal: the delivery cannot commit, and
// CompleteTx says why and what to do (sqllock.ErrSnapshotConflict) rather
// than failing with a bare serialization error. At READ COMMITTED (the
// advice) it commits. SQLite's transaction takes the write lock when it
// begins: no renewal can commit during the body (the heartbeat's Extend
// waits for the lock), so none conflicts, and the body commits.
func TestAttackLockTxWithHeartbeatCommitsABodyLongerThanAHeartbeat(t *testing.T) {
	type variant struct {
		name string
		e    engine
		dsn  string
		opts []sqllock.Option
		// conflict: the body cannot commit, and the error explains it.
		conflict bool
	}
	readCommitted := []sqllock.Option{sqllock.WithTxOptions(sql.TxOptions{Isolation: sql.LevelReadCommitted})}
	variants := []variant{
		{"postgres", postgres, "", nil, false},
		{"postgres/read-committed", postgres, "", readCommitted, false},
		{"postgres/repeatable-read", postgres, "", []sqllock.Option{sqllock.WithTxOptions(sql.TxOptions{Isolation: sql.LevelRepeatableRead})}, true},
		{"postgres/serializable", postgres, "", []sqllock.Option{sqllock.WithTxOptions(sql.TxOptions{Isolation: sql.LevelSerializable})}, true},
		{"mysql", mariadb, "", nil, false},
		{"mysql/snapshot-isolation", mariadb, "innodb_snapshot_isolation=ON", nil, true},
		{"mysql/snapshot-isolation/read-committed", mariadb, "innodb_snapshot_isolation=ON", readCommitted, false},
		{"sqlite", sqliteEngine, "", nil, false},
	}
	const heartbeat = idempotency.MinHeartbeat
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
			key := fmt.Sprintf("hb-%016x", rand.Uint64())
			var calls atomic.Int32
			err := idempotency.LockTx(t.Context(), b, key, func(ctx context.Context, tx *sql.Tx) error {
				calls.Add(1)
				var n int
				if err := tx.QueryRowContext(ctx, s.count, key).Scan(&n); err != nil {
					return err
				}
				start := leaseOf(t, e, db, b, key)
				if e.name == "sqlite" {
					// The transaction holds SQLite's write lock: the body goes
					// on for ten heartbeat periods, and no renewal lands.
					time.Sleep(10 * heartbeat)
					if now := leaseOf(t, e, db, b, key); now != start {
						return fmt.Errorf("the lease was renewed during the body (%d, then %d): the transaction did not hold the write lock", start, now)
					}
					return s.write(ctx, tx, key)
				}
				// The body's work lasts until the heartbeat has renewed the
				// lease once (it would, for any body longer than a period).
				for deadline := time.Now().Add(10 * time.Second); leaseOf(t, e, db, b, key) == start; {
					if time.Now().After(deadline) {
						return fmt.Errorf("no renewal within 10s")
					}
					time.Sleep(5 * time.Millisecond)
				}
				return s.write(ctx, tx, key)
			}, idempotency.WithLease(2*time.Second), idempotency.WithHeartbeat(heartbeat))
			t.Logf("LockTx: %v after %d body calls", err, calls.Load())
			if v.conflict {
				if !errors.Is(err, sqllock.ErrSnapshotConflict) {
					t.Fatalf("LockTx of a body longer than one heartbeat under snapshot isolation: %v, want an error wrapping ErrSnapshotConflict", err)
				}
				for _, says := range []string{"WithHeartbeat", "READ COMMITTED", "shorter than the heartbeat period"} {
					if !strings.Contains(err.Error(), says) {
						t.Errorf("the error does not mention %q", says)
					}
				}
				if n := s.rows(t, key); n != 0 {
					t.Fatalf("%d rows, want none", n)
				}
				if r := outcome(t, b, key); r.Outcome != store.Won {
					t.Fatalf("after: %v, want won (the claim released, nothing marked)", r.Outcome)
				}
				return
			}
			if err != nil {
				t.Fatalf("LockTx of a body longer than one heartbeat: %v, want nil (committed)", err)
			}
			if n := s.rows(t, key); n != 1 {
				t.Fatalf("%d rows, want 1", n)
			}
			if r := outcome(t, b, key); r.Outcome != store.AlreadyDone {
				t.Fatalf("after: %v, want already done", r.Outcome)
			}
		})
	}
}

// A body whose statement fails inside the transaction, and which goes on
// (the failed write was optional: an audit row, a cache table), returns
// nil. On PostgreSQL any failure aborts the transaction, so the mark's
// UPDATE fails and nothing commits (a nack). On MariaDB a deadlock rolls
// back the WHOLE transaction, the body's earlier writes with it, while
// the session carries on: the mark's UPDATE and the COMMIT then succeed
// on their own. CompleteTx answers true (ack) with the Done mark and
// without the body's effect: a lost delivery.
func TestAttackCompleteTxBodyThatSwallowsADeadlockDoesNotAckLostWrites(t *testing.T) {
	eachEngine(t, []engine{mariadb}, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil)
		s := newSink(t, e, db)
		ctx := t.Context()
		table := fmt.Sprintf("d_%016x", rand.Uint64())
		if _, err := db.Exec("CREATE TABLE " + table + " (id INTEGER PRIMARY KEY, v INTEGER NOT NULL)"); err != nil {
			t.Fatal(err)
		}
		heavy := fmt.Sprintf("h_%016x", rand.Uint64())
		if _, err := db.Exec("CREATE TABLE " + heavy + " (id INTEGER NOT NULL)"); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec("INSERT INTO " + table + " (id, v) VALUES (1, 0), (2, 0)"); err != nil {
			t.Fatal(err)
		}
		bump := rebind(e, "UPDATE "+table+" SET v = v + 1 WHERE id = ?")
		c := mustWin(t, b, "k", time.Minute)
		bodyHolds, otherHolds, otherWaits := make(chan struct{}), make(chan struct{}), make(chan error, 1)
		var swallowed error
		ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error {
			if swallowed != nil {
				return nil // a retry: the test looks at the first attempt
			}
			if err := s.write(ctx, tx, "k"); err != nil { // the effect
				return err
			}
			if _, err := tx.ExecContext(ctx, bump, 1); err != nil {
				return err
			}
			close(bodyHolds)
			// Another transaction, heavier (so that InnoDB picks the body
			// as the deadlock's victim), holds row 2 and waits for row 1.
			go func() {
				otx, err := db.BeginTx(ctx, nil)
				if err != nil {
					otherWaits <- err
					return
				}
				defer otx.Rollback()
				for i := range 50 {
					if _, err := otx.ExecContext(ctx, rebind(e, "INSERT INTO "+heavy+" (id) VALUES (?)"), i); err != nil {
						otherWaits <- err
						return
					}
				}
				if _, err := otx.ExecContext(ctx, bump, 2); err != nil {
					otherWaits <- err
					return
				}
				close(otherHolds)
				_, err = otx.ExecContext(ctx, bump, 1)
				if err == nil {
					err = otx.Commit()
				}
				otherWaits <- err
			}()
			<-otherHolds
			time.Sleep(200 * time.Millisecond) // the other waits for row 1
			// The optional write: it deadlocks; the body logs and goes on.
			_, swallowed = tx.ExecContext(ctx, bump, 2)
			if swallowed == nil {
				return fmt.Errorf("the body's second update did not deadlock")
			}
			var inTx int
			if err := tx.QueryRowContext(ctx, "SELECT @@in_transaction").Scan(&inTx); err != nil {
				return err
			}
			t.Logf("the body's optional update failed (swallowed): %v; @@in_transaction = %d", swallowed, inTx)
			return nil
		})
		t.Logf("CompleteTx: %v %v; the other transaction: %v", ok, err, <-otherWaits)
		if n := s.rows(t, "k"); ok && n != 1 {
			t.Fatalf("CompleteTx answered true (ack) but the body's effect has %d rows, want 1: the delivery is lost", n)
		}
	})
}

// Whatever a body does to its transaction or however it ends, CompleteTx
// (through LockTx) gives the connection back: with a pool of one
// connection, a LockTx of another key right after answers within seconds,
// and no connection is left in use.
func TestAttackLockTxLeaksNoConnection(t *testing.T) {
	eachEngine(t, networked, func(t *testing.T, e engine) {
		db := e.open(t, e.dsn(t), nil)
		db.SetMaxOpenConns(1)
		b := e.backend(t, db)
		s := newSink(t, e, e.open(t, e.dsn(t), nil))
		bodies := map[string]func(ctx context.Context, tx *sql.Tx) error{
			"panic": func(ctx context.Context, tx *sql.Tx) error {
				s.write(ctx, tx, "x")
				panic("boom")
			},
			"commits-itself": func(ctx context.Context, tx *sql.Tx) error {
				return tx.Commit()
			},
			"rolls-back-itself": func(ctx context.Context, tx *sql.Tx) error {
				return tx.Rollback()
			},
			"leaves-rows-open": func(ctx context.Context, tx *sql.Tx) error {
				_, err := tx.QueryContext(ctx, "SELECT 1 UNION ALL SELECT 2")
				return err
			},
			"returns-wrapped-txdone": func(ctx context.Context, tx *sql.Tx) error {
				return fmt.Errorf("wrapped: %w", sql.ErrTxDone)
			},
			"uses-tx-after-return": func(ctx context.Context, tx *sql.Tx) error {
				go func() {
					time.Sleep(50 * time.Millisecond)
					tx.ExecContext(context.Background(), s.ins, "late")
				}()
				return nil
			},
		}
		for name, body := range bodies {
			t.Run(name, func(t *testing.T) {
				key := fmt.Sprintf("%s-%016x", name, rand.Uint64())
				func() {
					defer func() { recover() }()
					err := idempotency.LockTx(t.Context(), b, key, body)
					t.Logf("LockTx: %v", err)
				}()
				time.Sleep(100 * time.Millisecond)
				ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
				defer cancel()
				if err := idempotency.LockTx(ctx, b, key+"-next", func(ctx context.Context, tx *sql.Tx) error { return s.write(ctx, tx, key+"-next") }); err != nil {
					t.Fatalf("the next LockTx on the one-connection pool: %v", err)
				}
				if st := db.Stats(); st.InUse != 0 {
					t.Fatalf("%d connections still in use", st.InUse)
				}
				if n := s.rows(t, "late"); n != 0 {
					t.Fatalf("a write after the body returned committed: %d rows", n)
				}
			})
		}
	})
}

// freezeProxy forwards TCP connections to a server until frozen: then it
// forwards nothing more in either direction and keeps every connection
// open on the server's side, as a network partition (or a frozen client
// host) leaves a session that the server still thinks alive.
type freezeProxy struct {
	ln     net.Listener
	frozen atomic.Bool
}

func newFreezeProxy(t testing.TB, target string) *freezeProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &freezeProxy{ln: ln}
	var held []net.Conn
	var mu sync.Mutex
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range held {
			c.Close()
		}
		mu.Unlock()
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			held = append(held, c, s)
			mu.Unlock()
			pipe := func(dst, src net.Conn) {
				buf := make([]byte, 32<<10)
				for {
					n, err := src.Read(buf)
					if p.frozen.Load() {
						return // swallow, and keep dst open
					}
					if n > 0 {
						dst.Write(buf[:n])
					}
					if err != nil {
						if !p.frozen.Load() {
							dst.Close()
						}
						return
					}
				}
			}
			go pipe(s, c)
			go pipe(c, s)
		}
	}()
	return p
}

// A commit that never reaches the server (the client's network froze as
// it was sent) leaves the server's transaction open, holding the row lock
// its mark's UPDATE took. CompleteTx must settle within its bound, and a
// concurrent duplicate's Claim of the key (another instance, whose own
// network is fine) must not hang on that row lock: it should answer
// (HeldByOther while the claim's lease runs) within seconds.
//
// On main both fail: the Claim waits on the row lock (PostgreSQL: until
// the server drops the session, which with default settings a partition
// does not make it do; MariaDB: innodb_lock_wait_timeout, 50 s, then an
// error), and on MariaDB CompleteTx never returns at all, whatever ctx
// says: go-sql-driver/mysql sends database/sql's Commit without a context
// and, with no readTimeout in the DSN, waits for its reply forever.
func TestAttackFrozenCommitDoesNotWedgeTheKey(t *testing.T) {
	eachEngine(t, networked, func(t *testing.T, e engine) {
		dsn := e.dsn(t)
		host := serverAddr(e, dsn)
		proxy := newFreezeProxy(t, host)
		c := &counter{}
		db := e.open(t, strings.Replace(dsn, host, proxy.ln.Addr().String(), 1), c)
		b := e.backend(t, db)
		direct := e.open(t, dsn, nil)
		other, err := sqllock.New(direct, e.dialect, sqllock.WithTable(tableOf(b)))
		if err != nil {
			t.Fatal(err)
		}
		s := newSink(t, e, direct)
		mine := mustWin(t, b, "k", 2*time.Second)
		freeze := func() { proxy.frozen.Store(true) }
		c.beforeCommit.Store(&freeze)
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		defer cancel()
		type res struct {
			ok  bool
			err error
		}
		done := make(chan res, 1)
		go func() {
			ok, err := b.CompleteTx(ctx, mine, "", func(ctx context.Context, tx *sql.Tx) error { return s.write(ctx, tx, "k") })
			done <- res{ok, err}
		}()
		time.Sleep(500 * time.Millisecond) // the commit is stuck in the frozen network
		cctx, ccancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer ccancel()
		start := time.Now()
		r, err := other.Claim(cctx, "k", time.Minute)
		t.Logf("a duplicate's Claim during the frozen commit: %v %v after %v", r.Outcome, err, time.Since(start).Round(time.Millisecond))
		if err != nil {
			t.Errorf("a duplicate's Claim hung on the frozen transaction's row lock: %v after %v", err, time.Since(start).Round(time.Millisecond))
		}
		select {
		case r := <-done:
			t.Logf("CompleteTx: %v %v", r.ok, r.err)
		case <-time.After(sqllock.SettleTimeout + 10*time.Second):
			t.Fatal("CompleteTx did not return within the settle timeout")
		}
	})
}
