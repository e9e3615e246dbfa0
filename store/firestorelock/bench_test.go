package firestorelock_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"cloud.google.com/go/firestore"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
)

type naiveRecord struct {
	State  int       `firestore:"state"`
	Fence  int64     `firestore:"fence"`
	Lease  time.Time `firestore:"lease_expiry"`
	Expiry time.Time `firestore:"expires_at"`
}

// naiveDelivery is the hand-rolled pattern with the official client: one
// read-write transaction to claim (begin, get, commit) and another to
// complete.
func naiveDelivery(ctx context.Context, c *firestore.Client, coll, key string) error {
	doc := c.Collection(coll).Doc(key)
	err := c.RunTransaction(ctx, func(ctx context.Context, tx *firestore.Transaction) error {
		var r naiveRecord
		snap, err := tx.Get(doc)
		if err == nil {
			if err := snap.DataTo(&r); err != nil {
				return err
			}
		} else if !snap.Exists() {
			err = nil
		}
		if err != nil {
			return err
		}
		r = naiveRecord{State: 1, Fence: r.Fence + 1, Lease: time.Now().Add(time.Minute), Expiry: time.Now().Add(time.Hour)}
		return tx.Set(doc, &r)
	})
	if err != nil {
		return err
	}
	return c.RunTransaction(ctx, func(ctx context.Context, tx *firestore.Transaction) error {
		var r naiveRecord
		snap, err := tx.Get(doc)
		if err != nil {
			return err
		}
		if err := snap.DataTo(&r); err != nil {
			return err
		}
		r.State = 2
		return tx.Set(doc, &r)
	})
}

// BenchmarkDelivery measures deliveries per second through Lock on the
// Firestore emulator, beside two naive read-write transactions per
// delivery with the official client in the same run, at 1 and 16
// concurrent workers. It reports the RPCs per delivery Lock sent.
func BenchmarkDelivery(b *testing.B) {
	testsvc.Firestore(b) // sets FIRESTORE_EMULATOR_HOST for the client
	ctx := context.Background()
	client, err := firestore.NewClient(ctx, project)
	if err != nil {
		b.Fatal(err)
	}
	defer client.Close()
	for _, workers := range []int{1, 16} {
		for _, kind := range []string{"naive-2-transactions", "lock"} {
			b.Run(fmt.Sprintf("%s/workers=%d", kind, workers), func(b *testing.B) {
				be, r := newBackend(b)
				coll := collection()
				run := func(key string) error {
					if kind == "lock" {
						return idempotency.Lock(ctx, be, key, noop)
					}
					return naiveDelivery(ctx, client, coll, key)
				}
				if err := run("warm-up"); err != nil {
					b.Fatal(err)
				}
				r.take()
				bench.Deliveries(b, workers, run)
				if kind == "lock" {
					b.ReportMetric(float64(len(r.take()))/float64(b.N), "RPCs/delivery")
				}
			})
		}
	}
}

// BenchmarkCompleteTx measures a delivery that writes one document of its
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
					ok, err = be.CompleteTx(ctx, r.Claim, "", func(ctx context.Context, tx *firestore.Transaction) error {
						return s.write(tx, key)
					})
				} else {
					if err = s.client.RunTransaction(ctx, func(ctx context.Context, tx *firestore.Transaction) error { return s.write(tx, key) }); err != nil {
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
