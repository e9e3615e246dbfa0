package spannerlock_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"cloud.google.com/go/spanner"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
)

// naiveDelivery is the hand-rolled pattern: one read-write transaction to
// claim (read the row, decide on the client's clock, write it back) and
// another to complete (read, check the fence, write), each a read and a
// commit.
func naiveDelivery(ctx context.Context, c *spanner.Client, table, key string) error {
	k := spanner.Key{[]byte(key)}
	cols := []string{"key", "state", "fence", "lease_expiry", "expires_at", "token"}
	var fence int64
	_, err := c.ReadWriteTransaction(ctx, func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
		fence = 1
		r, err := tx.ReadRow(ctx, table, k, []string{"fence"})
		if err == nil {
			var f int64
			if err := r.Columns(&f); err != nil {
				return err
			}
			fence = f + 1
		} else if spanner.ErrCode(err) != 5 { // NotFound
			return err
		}
		now := time.Now()
		return tx.BufferWrite([]*spanner.Mutation{spanner.InsertOrUpdate(table, cols,
			[]any{[]byte(key), int64(1), fence, now.Add(time.Minute), now.Add(time.Hour), "t"})})
	})
	if err != nil {
		return err
	}
	_, err = c.ReadWriteTransaction(ctx, func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
		r, err := tx.ReadRow(ctx, table, k, []string{"fence"})
		if err != nil {
			return err
		}
		var f int64
		if err := r.Columns(&f); err != nil {
			return err
		}
		if f != fence {
			return fmt.Errorf("fence %d, want %d", f, fence)
		}
		return tx.BufferWrite([]*spanner.Mutation{spanner.Update(table, []string{"key", "state", "expires_at"},
			[]any{[]byte(key), int64(2), time.Now().Add(time.Hour)})})
	})
	return err
}

// BenchmarkDelivery measures deliveries per second through Lock on the
// Spanner emulator, beside two naive read-write transactions per delivery
// in the same run, at 1 and 16 concurrent workers. The emulator runs one
// read-write transaction at a time per database, so the 16-worker runs
// measure its queue more than either pattern.
func BenchmarkDelivery(b *testing.B) {
	testsvc.Spanner(b)
	ctx := context.Background()
	for _, workers := range []int{1, 16} {
		for _, kind := range []string{"naive-2-transactions", "lock"} {
			b.Run(fmt.Sprintf("%s/workers=%d", kind, workers), func(b *testing.B) {
				db := database(b)
				be, r := newBackend(b, db)
				client := newClient(b, db, testsvc.Spanner(b), &rpcs{})
				run := func(key string) error {
					if kind == "lock" {
						return idempotency.Lock(ctx, be, key, noop)
					}
					// The emulator forgets all but one concurrent
					// transaction of a database (NotFound): run again.
					for {
						err := naiveDelivery(ctx, client, be.Table(), key)
						if err == nil || !strings.Contains(err.Error(), "ransaction") {
							return err
						}
					}
				}
				run("warm-up")
				r.take()
				b.ResetTimer() // not the database, the client and its sessions
				bench.Deliveries(b, workers, run)
				if kind == "lock" {
					b.ReportMetric(float64(len(r.take()))/float64(b.N), "RPCs/delivery")
				}
			})
		}
	}
}

func noop(context.Context) error { return nil }
