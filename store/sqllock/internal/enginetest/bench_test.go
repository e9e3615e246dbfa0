package enginetest

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
)

// BenchmarkDelivery measures deliveries per second through Lock on each
// engine, beside two baselines in the same run: two plain SELECT 1 round
// trips per delivery, and two plain single-row writes (an INSERT, then an
// UPDATE of that row) per delivery. At 1 and 16 concurrent workers.
func BenchmarkDelivery(b *testing.B) {
	noop := func(context.Context) error { return nil }
	for _, e := range engines {
		dsn := e.dsn(b)
		for _, workers := range []int{1, 16} {
			for _, kind := range []string{"baseline-2-selects", "baseline-2-writes", "lock"} {
				b.Run(fmt.Sprintf("%s/%s/workers=%d", e.name, kind, workers), func(b *testing.B) {
					c := &counter{}
					db := e.open(b, dsn, c)
					be := e.backend(b, db)
					ctx := context.Background()
					prefix := fmt.Sprint(time.Now().UnixNano(), ":")
					table := tableOf(be) + "_plain"
					ins, upd := "INSERT INTO %s (k, v) VALUES (?, 0)", "UPDATE %s SET v = 1 WHERE k = ?"
					if e.name == "postgres" {
						ins, upd = "INSERT INTO %s (k, v) VALUES ($1, 0)", "UPDATE %s SET v = 1 WHERE k = $1"
					}
					ins, upd = fmt.Sprintf(ins, table), fmt.Sprintf(upd, table)
					if _, err := db.Exec("CREATE TABLE " + table + " (k VARCHAR(200) PRIMARY KEY, v INTEGER NOT NULL)"); err != nil {
						b.Fatal(err)
					}
					run := func(key string) error {
						switch kind {
						case "lock":
							return idempotency.Lock(ctx, be, prefix+key, noop)
						case "baseline-2-writes":
							if _, err := db.ExecContext(ctx, ins, prefix+key); err != nil {
								return err
							}
							_, err := db.ExecContext(ctx, upd, prefix+key)
							return err
						}
						return selects(ctx, db)
					}
					run("warm-up")
					c.n.Store(0)
					bench.Deliveries(b, workers, run)
					b.ReportMetric(float64(c.n.Load())/float64(b.N), "round-trips/delivery")
				})
			}
		}
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
