package enginetest

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/txstorm"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// A crash storm on each engine, whose sink is a table in the same
// database as the records: workers deliver orders with LockTx while the
// storm SIGKILLs them, also between a body's write and its commit. Every
// order's row must exist exactly once.
func TestTxStorm(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) { txStorm(t, e, false, nil) })
}

// The crash storm again with every delivery under WithHeartbeat (200ms,
// a lease of 2s: renewals run beside the body and its commit; 150 orders,
// 80 on SQLite), with a
// tenth of the bodies panicking after their write and a tenth ending
// their transaction through the engine (endTx) and swallowing the error:
// still no order lost and none twice.
func TestTxStormUnderAHeartbeatWithPanicsAndSwallowedEnds(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		txStorm(t, e, false, func(c *txstorm.Config[*sql.Tx]) {
			c.Orders = 150
			if e.name == "sqlite" {
				// Its one writer serializes bodies that last up to two
				// heartbeats: fewer orders keep the storm's time near the
				// others'.
				c.Orders = 80
			}
			c.Lease = 2 * time.Second
			c.Heartbeat = 200 * time.Millisecond
			c.PanicRate, c.SwallowRate = 0.1, 0.1
			c.EndTx = endTx(e, "")
		})
	})
}

// The storm tells a sink that writes outside the transaction: its rows
// commit even when the worker dies before the done mark, and the
// redelivery writes them again.
func TestTxStormCatchesWritesOutsideTheTransaction(t *testing.T) {
	eachEngine(t, networked[:1], func(t *testing.T, e engine) {
		if f := txStorm(t, e, true, nil); !txstorm.IsWorker() && f.Duplicated == 0 {
			t.Fatalf("the storm found nothing wrong with a sink that writes outside the transaction: %v", f)
		}
	})
}

// txStorm runs the storm on e; broken makes the sink write outside the
// body's transaction, and more, when not nil, sets the storm's other
// options.
func txStorm(t *testing.T, e engine, broken bool, more func(*txstorm.Config[*sql.Tx])) txstorm.Figures {
	dsn, table, sinkTable := os.Getenv("TXSTORM_DSN"), os.Getenv("TXSTORM_TABLE"), os.Getenv("TXSTORM_SINK")
	if !txstorm.IsWorker() {
		dsn = e.dsn(t)
		suffix := fmt.Sprintf("%016x", rand.Uint64())
		table, sinkTable = "storm_"+suffix, "sink_"+suffix
		db := e.open(t, dsn, nil)
		b, err := sqllock.New(db, e.dialect, sqllock.WithTable(table))
		if err != nil {
			t.Fatal(err)
		}
		if err := b.EnsureSchema(t.Context()); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec("CREATE TABLE " + sinkTable + " (id VARCHAR(200) NOT NULL, n INTEGER NOT NULL)"); err != nil {
			t.Fatal(err)
		}
	}
	var db *sql.DB
	open := func(t testing.TB) *sql.DB {
		if db == nil {
			db = e.open(t, dsn, nil)
		}
		return db
	}
	ins := rebind(e, "INSERT INTO "+sinkTable+" (id, n) VALUES (?, 1)")
	run := txstorm.Run[*sql.Tx]
	if broken {
		run = txstorm.Storm[*sql.Tx]
	}
	cfg := txstorm.Config[*sql.Tx]{
		Env: []string{"TXSTORM_DSN=" + dsn, "TXSTORM_TABLE=" + table, "TXSTORM_SINK=" + sinkTable},
		Backend: func(t testing.TB) store.TxBackend[*sql.Tx] {
			b, err := sqllock.New(open(t), e.dialect, sqllock.WithTable(table))
			if err != nil {
				t.Fatal(err)
			}
			return b
		},
		Write: func(ctx context.Context, tx *sql.Tx, order string) error {
			if broken {
				_, err := open(t).ExecContext(ctx, ins, order)
				return err
			}
			_, err := tx.ExecContext(ctx, ins, order)
			return err
		},
		Count: func(ctx context.Context) (map[string]int, error) {
			rows, err := open(t).QueryContext(ctx, "SELECT id, COUNT(*) FROM "+sinkTable+" GROUP BY id")
			if err != nil {
				return nil, err
			}
			defer rows.Close()
			m := map[string]int{}
			for rows.Next() {
				var id string
				var n int
				if err := rows.Scan(&id, &n); err != nil {
					return nil, err
				}
				m[id] = n
			}
			return m, rows.Err()
		},
	}
	if more != nil {
		more(&cfg)
	}
	return run(t, cfg)
}
