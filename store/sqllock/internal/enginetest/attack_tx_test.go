package enginetest

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"strings"
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
// WithHeartbeat (the documented way to run work longer than the lease),
// must still commit. The body reads (as most bodies do: a balance, a
// stock level) before it writes, which fixes its snapshot; the heartbeat
// then renews the lease, an UPDATE of the very record the transaction
// marks done at its end. Wherever the mark's UPDATE refuses a row changed
// since the snapshot (PostgreSQL at REPEATABLE READ or SERIALIZABLE,
// MariaDB with innodb_snapshot_isolation, SQLite's stale snapshot on the
// first write), each attempt fails, is retried with the body again, meets
// the next renewal, and the delivery can never commit.
func TestAttackLockTxWithHeartbeatCommitsABodyLongerThanAHeartbeat(t *testing.T) {
	type variant struct {
		name string
		e    engine
		dsn  string
		opts []sqllock.Option
	}
	variants := []variant{
		{"postgres", postgres, "", nil},
		{"postgres/repeatable-read", postgres, "", []sqllock.Option{sqllock.WithTxOptions(sql.TxOptions{Isolation: sql.LevelRepeatableRead})}},
		{"postgres/serializable", postgres, "", []sqllock.Option{sqllock.WithTxOptions(sql.TxOptions{Isolation: sql.LevelSerializable})}},
		{"mysql", mariadb, "", nil},
		{"mysql/snapshot-isolation", mariadb, "innodb_snapshot_isolation=ON", nil},
		{"sqlite", sqliteEngine, "", nil},
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
			key := fmt.Sprintf("hb-%016x", rand.Uint64())
			var calls atomic.Int32
			err := idempotency.LockTx(t.Context(), b, key, func(ctx context.Context, tx *sql.Tx) error {
				calls.Add(1)
				var n int
				if err := tx.QueryRowContext(ctx, s.count, key).Scan(&n); err != nil {
					return err
				}
				// The body's work lasts until the heartbeat has renewed the
				// lease once (it would, for any body longer than a period).
				start := leaseOf(t, e, db, b, key)
				for deadline := time.Now().Add(10 * time.Second); leaseOf(t, e, db, b, key) == start; {
					if time.Now().After(deadline) {
						return fmt.Errorf("no renewal within 10s")
					}
					time.Sleep(5 * time.Millisecond)
				}
				return s.write(ctx, tx, key)
			}, idempotency.WithLease(2*time.Second), idempotency.WithHeartbeat(20*time.Millisecond))
			t.Logf("LockTx: %v after %d body calls", err, calls.Load())
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
