package enginetest

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// BenchmarkDelivery measures deliveries per second through Lock on each
// engine, beside two baselines in the same run: two plain SELECT 1 round
// trips per delivery, and two plain single-row writes per delivery (an
// INSERT of a fresh record, on PostgreSQL with ON CONFLICT DO NOTHING, then
// an UPDATE of that row marking it done). At 1 and 16 concurrent workers.
// Before the timer starts each worker makes 8 deliveries (bench.Warm): the
// pool's connections are open and past PostgreSQL's custom plans of a
// prepared statement's first five executions on a connection.
//
// The writes baseline is held to what Lock pays: a table of the same DDL
// (Schema: the same columns, primary key and index on expires_at_ms, so
// both writes maintain the same indexes), the same key and row values,
// prepared statements (as the backend's are), the same connection pool and
// durability settings (the same database), autocommit.
func BenchmarkDelivery(b *testing.B) {
	noop := func(context.Context) error { return nil }
	for _, e := range engines {
		dsn := e.dsn(b)
		for _, workers := range []int{1, 16} {
			for _, kind := range []string{"baseline-2-selects", "baseline-2-writes", "lock"} {
				b.Run(fmt.Sprintf("%s/%s/workers=%d", e.name, kind, workers), func(b *testing.B) {
					c := &counter{}
					db := e.open(b, dsn, c)
					run := deliveryRun(b, e, db, kind, noop)
					bench.Warm(b, workers, 8, run)
					c.n.Store(0)
					bench.Deliveries(b, workers, run)
					b.ReportMetric(float64(c.n.Load())/float64(b.N), "round-trips/delivery")
				})
			}
		}
	}
}

// deliveryRun returns what one delivery of kind does on db: Lock (with
// body) on a new table, or a baseline on a table of the same shape.
func deliveryRun(b *testing.B, e engine, db *sql.DB, kind string, body func(context.Context) error) func(key string) error {
	b.Helper()
	be := e.backend(b, db)
	ctx := context.Background()
	prefix := fmt.Sprint(time.Now().UnixNano(), ":")
	switch kind {
	case "lock":
		return func(key string) error { return idempotency.Lock(ctx, be, prefix+key, body) }
	case "baseline-2-selects":
		return func(string) error { return selects(ctx, db) }
	}
	plain := e.backend(b, db) // the same DDL, another table
	ins := "INSERT INTO " + tableOf(plain) + " (idem_key, state, fence, lease_expiry_ms, expires_at_ms, token) VALUES (?, 1, 1, ?, ?, ?)"
	upd := "UPDATE " + tableOf(plain) + " SET state = 2, expires_at_ms = ? WHERE idem_key = ?"
	if e.name == "postgres" {
		ins = "INSERT INTO " + tableOf(plain) + " (idem_key, state, fence, lease_expiry_ms, expires_at_ms, token) VALUES ($1, 1, 1, $2, $3, $4) ON CONFLICT DO NOTHING"
		upd = "UPDATE " + tableOf(plain) + " SET state = 2, expires_at_ms = $1 WHERE idem_key = $2"
	}
	insSt, err := db.PrepareContext(ctx, ins)
	if err != nil {
		b.Fatal(err)
	}
	updSt, err := db.PrepareContext(ctx, upd)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { insSt.Close(); updSt.Close() })
	return func(key string) error {
		k := []byte(prefix + key)
		now := time.Now().UnixMilli()
		lease := now + store.DefaultLease.Milliseconds()
		if _, err := insSt.ExecContext(ctx, k, lease, lease+store.DefaultTTL.Milliseconds(), store.NewToken()); err != nil {
			return err
		}
		_, err := updSt.ExecContext(ctx, now+store.DefaultTTL.Milliseconds(), k)
		return err
	}
}

func selects(ctx context.Context, db *sql.DB) error {
	var one int
	for range 2 {
		if err := db.QueryRowContext(ctx, "SELECT 1").Scan(&one); err != nil {
			return err
		}
	}
	return nil
}

// BenchmarkCompleteTx measures a transactional completion beside the plain
// path doing the same write, interleaved in one loop on fresh keys so that
// both see the same machine: per delivery, a Claim, then either CompleteTx
// with a body inserting one row into a table of the caller's (begin, the
// insert, the conditional UPDATE, commit), or a separate transaction
// with the same insert followed by a plain Complete (begin, the insert,
// commit, the UPDATE). ns/op is both; tx-ns/delivery and
// plain-ns/delivery each, and tx/plain their ratio.
func BenchmarkCompleteTx(b *testing.B) {
	for _, e := range engines {
		b.Run(e.name, func(b *testing.B) {
			db, be := e.fresh(b, nil)
			s := newSink(b, e, db)
			ctx := context.Background()
			prefix := fmt.Sprint(time.Now().UnixNano(), ":")
			var txTime, plainTime time.Duration
			i := 0
			for b.Loop() {
				i++
				key := fmt.Sprint(prefix, i)
				start := time.Now()
				c := mustWin(b, be, key, time.Minute)
				ok, err := be.CompleteTx(ctx, c, "", func(ctx context.Context, tx *sql.Tx) error { return s.write(ctx, tx, key) })
				if !ok || err != nil {
					b.Fatal(ok, err)
				}
				txTime += time.Since(start)

				key += "p"
				start = time.Now()
				c = mustWin(b, be, key, time.Minute)
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					b.Fatal(err)
				}
				if err := s.write(ctx, tx, key); err != nil {
					b.Fatal(err)
				}
				if err := tx.Commit(); err != nil {
					b.Fatal(err)
				}
				if ok, err := be.Complete(ctx, c); !ok || err != nil {
					b.Fatal(ok, err)
				}
				plainTime += time.Since(start)
			}
			b.ReportMetric(float64(txTime.Nanoseconds())/float64(b.N), "tx-ns/delivery")
			b.ReportMetric(float64(plainTime.Nanoseconds())/float64(b.N), "plain-ns/delivery")
			b.ReportMetric(float64(txTime)/float64(plainTime), "tx/plain")
		})
	}
}
