package spannerlock_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"cloud.google.com/go/spanner"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
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
// in the same run, at 1 to 64 concurrent workers, each delivery to a fresh
// key. It reports the RPCs each sends per delivery and the time those RPCs
// took (rpc-ms/delivery, summed over concurrent calls). The emulator runs
// one read-write transaction at a time per database, so the runs with
// more workers measure its queue more than either pattern; and its SQL
// engine reads the whole table for a query or DML statement on one key,
// where the naive pattern's reads and mutations go by key, so the lock's
// cost per delivery grows with the rows the run has written
// (BenchmarkDeliveryOnAFilledTable).
func BenchmarkDelivery(b *testing.B) {
	testsvc.Spanner(b)
	for _, workers := range []int{1, 4, 16, 64} {
		for _, kind := range []string{"naive-2-transactions", "lock"} {
			b.Run(fmt.Sprintf("%s/workers=%d", kind, workers), func(b *testing.B) {
				benchDeliveries(b, kind, workers, 0)
			})
		}
	}
}

// BenchmarkDeliveryOnAFilledTable is BenchmarkDelivery at one worker on a
// table that holds rows=N other keys' rows before the run: what the
// emulator's whole-table reads cost each pattern.
func BenchmarkDeliveryOnAFilledTable(b *testing.B) {
	testsvc.Spanner(b)
	for _, rows := range []int{0, 10000} {
		for _, kind := range []string{"naive-2-transactions", "lock"} {
			b.Run(fmt.Sprintf("%s/rows=%d", kind, rows), func(b *testing.B) {
				benchDeliveries(b, kind, 1, rows)
			})
		}
	}
}

// benchDeliveries runs BenchmarkDelivery's deliveries of kind on a
// database of their own that holds rows other rows first.
func benchDeliveries(b *testing.B, kind string, workers, rows int) {
	ctx := context.Background()
	db := database(b)
	be, r := newBackend(b, db)
	nr := &rpcs{}
	client := newClient(b, db, testsvc.Spanner(b), nr)
	fill(b, client, be.Table(), rows)
	run := func(key string) error {
		if kind == "lock" {
			return idempotency.Lock(ctx, be, key, noop)
		}
		// The emulator forgets all but one concurrent transaction of a
		// database (NotFound): run again.
		for {
			err := naiveDelivery(ctx, client, be.Table(), key)
			if err == nil || !strings.Contains(err.Error(), "ransaction") {
				return err
			}
		}
	}
	run("warm-up")
	if kind != "lock" {
		r = nr
	}
	r.take()
	r.takeSpent()
	b.ResetTimer() // not the database, the client and its sessions
	bench.Deliveries(b, workers, run)
	b.ReportMetric(float64(len(r.take()))/float64(b.N), "RPCs/delivery")
	var spent time.Duration
	for _, d := range r.takeSpent() {
		spent += d
	}
	b.ReportMetric(float64(spent.Microseconds())/1000/float64(b.N), "rpc-ms/delivery")
}

// fill writes n expired Done rows of keys "filled/i" into table, a
// thousand to a commit.
func fill(b testing.TB, c *spanner.Client, table string, n int) {
	b.Helper()
	past := time.Now().Add(-time.Hour)
	cols := []string{"key", "state", "fence", "lease_expiry", "expires_at", "token"}
	for i := 0; i < n; {
		var ms []*spanner.Mutation
		for ; i < n && len(ms) < 1000; i++ {
			ms = append(ms, spanner.Insert(table, cols, []any{[]byte(fmt.Sprintf("filled/%07d", i)), int64(2), int64(1), past, past, "t"}))
		}
		if _, err := c.Apply(context.Background(), ms); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRaceOneKey measures one race: racers deliveries of one fresh
// key through Lock at once, each on a client of its own (as instances
// are), until every one has its answer: one runs the body, the others get
// ErrDuplicate or ErrInProgress.
func BenchmarkRaceOneKey(b *testing.B) {
	testsvc.Spanner(b)
	ctx := context.Background()
	for _, racers := range []int{1, 4, 16, 64} {
		b.Run(fmt.Sprintf("racers=%d", racers), func(b *testing.B) {
			db := database(b)
			bes := make([]*spannerlock.Backend, racers)
			for i := range bes {
				bes[i], _ = newBackend(b, db)
				idempotency.Lock(ctx, bes[i], fmt.Sprint("warm-up-", i), noop)
			}
			var ran, other atomic.Int64
			b.ResetTimer()
			for n := range b.N {
				key := fmt.Sprint("race-", n)
				var wg sync.WaitGroup
				for _, be := range bes {
					wg.Go(func() {
						err := idempotency.Lock(ctx, be, key, func(context.Context) error { ran.Add(1); return nil })
						switch {
						case err == nil:
						case errors.Is(err, idempotency.ErrDuplicate), errors.Is(err, idempotency.ErrInProgress):
							other.Add(1)
						default:
							b.Error(err)
						}
					})
				}
				wg.Wait()
			}
			b.StopTimer()
			if ran.Load() != int64(b.N) {
				b.Fatalf("the body ran %d times in %d races", ran.Load(), b.N)
			}
		})
	}
}

// BenchmarkPurgeExpired measures PurgeExpired deleting rows=N expired
// rows (one op is one purge of the whole table), and reports rows/s,
// beside the statement it ran before (kind dml-in-unnest: one DML DELETE
// over each batch's keys) in the same run.
func BenchmarkPurgeExpired(b *testing.B) {
	testsvc.Spanner(b)
	ctx := context.Background()
	for _, rows := range []int{1000, 10000} {
		for _, kind := range []string{"dml-in-unnest", "backend"} {
			b.Run(fmt.Sprintf("%s/rows=%d", kind, rows), func(b *testing.B) {
				db := database(b)
				be, _ := newBackend(b, db)
				client := newClient(b, db, testsvc.Spanner(b), &rpcs{})
				purge := be.PurgeExpired
				if kind == "dml-in-unnest" {
					purge = func(ctx context.Context, _ int) (int, error) { return purgeByDML(ctx, client, be.Table()) }
				}
				var spent time.Duration
				for range b.N {
					b.StopTimer()
					fill(b, client, be.Table(), rows)
					b.StartTimer()
					start := time.Now()
					n, err := purge(ctx, 0)
					spent += time.Since(start)
					if err != nil || n != rows {
						b.Fatalf("purged %d of %d: %v", n, rows, err)
					}
				}
				b.ReportMetric(float64(rows*b.N)/spent.Seconds(), "rows/s")
			})
		}
	}
}

// purgeByDML is the first version's PurgeExpired: batches of a thousand
// expired keys, each deleted by one DML statement that checks expires_at
// again.
func purgeByDML(ctx context.Context, c *spanner.Client, table string) (int, error) {
	total := 0
	for {
		var keys [][]byte
		err := c.Single().Query(ctx, spanner.Statement{
			SQL: "SELECT key FROM " + table + " WHERE expires_at < CURRENT_TIMESTAMP() LIMIT 1000",
		}).Do(func(r *spanner.Row) error {
			var k []byte
			keys = append(keys, k)
			return r.Columns(&keys[len(keys)-1])
		})
		if err != nil || len(keys) == 0 {
			return total, err
		}
		var n int64
		_, err = c.ReadWriteTransaction(ctx, func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
			var err error
			n, err = tx.Update(ctx, spanner.Statement{
				SQL:    "DELETE FROM " + table + " WHERE key IN UNNEST(@keys) AND expires_at < CURRENT_TIMESTAMP()",
				Params: map[string]any{"keys": keys},
			})
			return err
		})
		if err != nil {
			return total, err
		}
		total += int(n)
	}
}

func noop(context.Context) error { return nil }

// BenchmarkCompleteTx measures completing a claimed key together with one
// business write (an INSERT of one row) in two ways, interleaved on one
// database so that both see the same load: CompleteTx (the write and the
// Done mark in one transaction) and the plain path (the write in a
// transaction of its own, then Complete). Each op is one of each, on
// fresh keys; the Claims before them are not timed. It reports each
// path's time per delivery, their ratio (tx/plain) and RPCs per delivery.
func BenchmarkCompleteTx(b *testing.B) {
	testsvc.Spanner(b)
	ctx := context.Background()
	db := txDatabase(b)
	r := &rpcs{}
	client := newClient(b, db, testsvc.Spanner(b), r)
	be, err := spannerlock.New(client)
	if err != nil {
		b.Fatal(err)
	}
	claim := func(key string) store.Claim {
		res, err := be.Claim(ctx, key, time.Minute)
		if err != nil || res.Outcome != store.Won {
			b.Fatalf("claim %q: %+v %v", key, res, err)
		}
		return res.Claim
	}
	write := func(key string) func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
		return func(ctx context.Context, tx *spanner.ReadWriteTransaction) error { return effect(ctx, tx, key) }
	}
	// Warm up the client's sessions and both statements' plans.
	if _, err := be.CompleteTx(ctx, claim("warm-up"), "", write("warm-up")); err != nil {
		b.Fatal(err)
	}
	var txTime, plainTime time.Duration
	var txRPCs, plainRPCs int
	b.ResetTimer()
	for i := range b.N {
		tk, pk := fmt.Sprint("tx-", i), fmt.Sprint("plain-", i)
		tc, pc := claim(tk), claim(pk)
		r.take()
		start := time.Now()
		if ok, err := be.CompleteTx(ctx, tc, "", write(tk)); !ok || err != nil {
			b.Fatalf("CompleteTx: %v %v", ok, err)
		}
		txTime += time.Since(start)
		txRPCs += len(r.take())
		start = time.Now()
		if _, err := client.ReadWriteTransaction(ctx, write(pk)); err != nil {
			b.Fatal(err)
		}
		if ok, err := be.Complete(ctx, pc); !ok || err != nil {
			b.Fatalf("Complete: %v %v", ok, err)
		}
		plainTime += time.Since(start)
		plainRPCs += len(r.take())
	}
	b.StopTimer()
	n := float64(b.N)
	b.ReportMetric(float64(txTime.Microseconds())/1000/n, "tx-ms/delivery")
	b.ReportMetric(float64(plainTime.Microseconds())/1000/n, "plain-ms/delivery")
	b.ReportMetric(float64(txTime)/float64(plainTime), "tx/plain")
	b.ReportMetric(float64(txRPCs)/n, "tx-RPCs/delivery")
	b.ReportMetric(float64(plainRPCs)/n, "plain-RPCs/delivery")
}
