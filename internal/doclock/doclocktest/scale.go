package doclocktest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
)

// How cost grows (docs/scaling/datastore.md, docs/scaling/firestore.md):
// a delivery through Lock at 1 to 64 workers, N deliveries racing one key,
// and PurgeExpired on expired records while claims run, all on the
// emulator. Each driver's Benchmark functions run these.

// BenchScaling is a delivery through Lock at 1, 4, 16 and 64 workers.
func BenchScaling(b *testing.B, d Driver) {
	d.Emulator(b)
	ctx := context.Background()
	for _, workers := range []int{1, 4, 16, 64} {
		b.Run(fmt.Sprintf("lock/workers=%d", workers), func(b *testing.B) {
			be, r := d.New(b, Config{})
			run := func(key string) error {
				return idempotency.Lock(ctx, be, key, func(context.Context) error { return nil })
			}
			if err := run("warm-up"); err != nil {
				b.Fatal(err)
			}
			r.Take()
			b.ResetTimer()
			bench.Deliveries(b, workers, run)
			b.ReportMetric(float64(len(r.Take()))/float64(b.N), "RPCs/delivery")
		})
	}
}

// BenchRace has N deliveries of one key race (N at once, a fresh key
// each round): one runs the body, the others are told it is in progress
// or done. RPCs/key is what the race costs the service.
func BenchRace(b *testing.B, d Driver) {
	d.Emulator(b)
	ctx := context.Background()
	for _, racers := range []int{2, 8, 32} {
		b.Run(fmt.Sprintf("lock/racers=%d", racers), func(b *testing.B) {
			be, r := d.New(b, Config{})
			var bodies atomic.Int64
			body := func(context.Context) error { bodies.Add(1); return nil }
			run := func(key string) error {
				err := idempotency.Lock(ctx, be, key, body)
				if errors.Is(err, idempotency.ErrInProgress) || errors.Is(err, idempotency.ErrDuplicate) {
					return nil
				}
				return err
			}
			if err := run("warm-up"); err != nil {
				b.Fatal(err)
			}
			bodies.Store(0)
			r.Take()
			b.ResetTimer()
			bench.Race(b, racers, run)
			b.StopTimer()
			if n := bodies.Load(); n != int64(b.N) {
				b.Fatalf("%d bodies ran for %d keys", n, b.N)
			}
			b.ReportMetric(float64(len(r.Take()))/float64(b.N), "RPCs/key")
		})
	}
}

// purgeRecords is how many expired records BenchPurgeWhileClaiming
// purges: IDEMPOTENCY_PURGE_RECORDS, default 10000.
func purgeRecords(b *testing.B) int {
	if s := os.Getenv("IDEMPOTENCY_PURGE_RECORDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			b.Fatalf("IDEMPOTENCY_PURGE_RECORDS=%q", s)
		}
		return n
	}
	return 10000
}

// BenchPurgeWhileClaiming writes expired records (500 per Commit, as
// an older run would have left them) and times one PurgeExpired over them
// while 4 workers claim fresh keys in the same space.
func BenchPurgeWhileClaiming(b *testing.B, d Driver) {
	d.Emulator(b)
	ctx := context.Background()
	n := purgeRecords(b)
	b.Run(fmt.Sprintf("records=%d/claimers=4", n), func(b *testing.B) {
		for range b.N {
			b.StopTimer()
			ns := d.Space()
			be, _ := d.New(b, Config{Space: ns})
			SeedExpired(b, d, ns, n)
			b.StartTimer()
			bench.PurgeWhileClaiming(b, n, 4,
				func() (int, error) { return be.PurgeExpired(ctx, 0) },
				func(key string) error { _, err := be.Claim(ctx, key, time.Minute); return err })
		}
	})
}

// BenchDelivery measures deliveries per second through Lock on d's
// emulator, beside naive (the hand-rolled pattern with the service's
// client: two read-write transactions per delivery, one to claim and one
// to complete, on key in space) in the same run, at 1 and 16 concurrent
// workers. It reports the RPCs per delivery Lock sent.
func BenchDelivery(b *testing.B, d Driver, naive func(ctx context.Context, space, key string) error) {
	d.Emulator(b)
	ctx := context.Background()
	for _, workers := range []int{1, 16} {
		for _, kind := range []string{"naive-2-transactions", "lock"} {
			b.Run(fmt.Sprintf("%s/workers=%d", kind, workers), func(b *testing.B) {
				be, r := d.New(b, Config{})
				space := d.Space()
				run := func(key string) error {
					if kind == "lock" {
						return idempotency.Lock(ctx, be, key, func(context.Context) error { return nil })
					}
					return naive(ctx, space, key)
				}
				if err := run("warm-up"); err != nil {
					b.Fatal(err)
				}
				r.Take()
				bench.Deliveries(b, workers, run)
				if kind == "lock" {
					b.ReportMetric(float64(len(r.Take()))/float64(b.N), "RPCs/delivery")
				}
			})
		}
	}
}

// BenchCompleteTx measures a delivery that writes one document (entity) of
// its own, on fresh keys: Claim, then CompleteTx with the write in its
// body (one transaction), beside Claim, a separate transaction with the
// same write (Sink.RunTx), and a plain Complete.
func BenchCompleteTx[Tx any](b *testing.B, d TxDriver[Tx]) {
	s := d.Sink(b)
	ctx := context.Background()
	for _, kind := range []string{"plain-complete+write-transaction", "complete-tx"} {
		b.Run(kind, func(b *testing.B) {
			be, _ := asTx[Tx](d.New(b, Config{}))
			i := 0
			for b.Loop() {
				i++
				key := fmt.Sprintf("%s-%d", kind, i)
				r, err := be.Claim(ctx, key, time.Minute)
				if err != nil {
					b.Fatal(err)
				}
				var ok bool
				if kind == "complete-tx" {
					ok, err = be.CompleteTx(ctx, r.Claim, "", func(ctx context.Context, tx Tx) error { return s.Write(tx, key) })
				} else {
					if err = s.RunTx(ctx, func(tx Tx) error { return s.Write(tx, key) }); err != nil {
						b.Fatal(err)
					}
					ok, err = be.Complete(ctx, r.Claim)
				}
				if !ok || err != nil {
					b.Fatal(ok, err)
				}
			}
		})
	}
}
