package datastorelock_test

import (
	"context"
	"testing"
	"time"

	"cloud.google.com/go/datastore"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
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
	client, err := datastore.NewClient(context.Background(), project)
	if err != nil {
		b.Fatal(err)
	}
	defer client.Close()
	doclocktest.BenchDelivery(b, driver{}, func(ctx context.Context, ns, key string) error { return naiveDelivery(ctx, client, ns, key) })
}

// BenchmarkCompleteTx measures a delivery that writes one entity of its
// own (doclocktest.BenchCompleteTx).
func BenchmarkCompleteTx(b *testing.B) {
	doclocktest.BenchCompleteTx[*datastore.Transaction](b, driver{})
}
