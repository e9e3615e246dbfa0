package datastorelock_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"cloud.google.com/go/datastore"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
)

type naiveRecord struct {
	State  int
	Fence  int64
	Lease  time.Time
	Expiry time.Time
}

// naiveDelivery is the hand-rolled pattern: one read-write transaction to
// claim (begin, get, put, commit) and another to complete.
func naiveDelivery(ctx context.Context, c *datastore.Client, ns, key string) error {
	k := datastore.NameKey("Naive", key, nil)
	k.Namespace = ns
	_, err := c.RunInTransaction(ctx, func(tx *datastore.Transaction) error {
		var r naiveRecord
		if err := tx.Get(k, &r); err != nil && err != datastore.ErrNoSuchEntity {
			return err
		}
		r = naiveRecord{State: 1, Fence: r.Fence + 1, Lease: time.Now().Add(time.Minute), Expiry: time.Now().Add(time.Hour)}
		_, err := tx.Put(k, &r)
		return err
	})
	if err != nil {
		return err
	}
	_, err = c.RunInTransaction(ctx, func(tx *datastore.Transaction) error {
		var r naiveRecord
		if err := tx.Get(k, &r); err != nil {
			return err
		}
		r.State = 2
		_, err := tx.Put(k, &r)
		return err
	})
	return err
}

// BenchmarkDelivery measures deliveries per second through Lock on the
// Datastore emulator, beside two naive read-write transactions per delivery
// (6 RPCs) in the same run, at 1 and 16 concurrent workers.
func BenchmarkDelivery(b *testing.B) {
	testsvc.Datastore(b)
	ctx := context.Background()
	client, err := datastore.NewClient(ctx, project)
	if err != nil {
		b.Fatal(err)
	}
	defer client.Close()
	for _, workers := range []int{1, 16} {
		for _, kind := range []string{"naive-2-transactions", "lock"} {
			b.Run(fmt.Sprintf("%s/workers=%d", kind, workers), func(b *testing.B) {
				be, r := newBackend(b)
				ns := namespace()
				run := func(key string) error {
					if kind == "lock" {
						return idempotency.Lock(ctx, be, key, noop)
					}
					return naiveDelivery(ctx, client, ns, key)
				}
				run("warm-up")
				r.take()
				bench.Deliveries(b, workers, run)
				if kind == "lock" {
					b.ReportMetric(float64(len(r.take()))/float64(b.N), "RPCs/delivery")
				}
			})
		}
	}
}

// BenchmarkCompleteTx measures a delivery that writes one entity of its
// own, on fresh keys: Claim, then CompleteTx with the write in its body
// (one transaction), beside Claim, a separate transaction with the same
// write, and a plain Complete.
func BenchmarkCompleteTx(b *testing.B) {
	s := newSink(b)
	ctx := context.Background()
	for _, kind := range []string{"plain-complete+write-transaction", "complete-tx"} {
		b.Run(kind, func(b *testing.B) {
			be, _ := newBackend(b)
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
					ok, err = be.CompleteTx(ctx, r.Claim, "", func(ctx context.Context, tx *datastore.Transaction) error {
						return s.write(tx, key)
					})
				} else {
					if _, err = s.client.RunInTransaction(ctx, func(tx *datastore.Transaction) error { return s.write(tx, key) }); err != nil {
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
