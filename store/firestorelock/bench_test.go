package firestorelock_test

import (
	"context"
	"testing"
	"time"

	"cloud.google.com/go/firestore"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
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
// concurrent workers.
func BenchmarkDelivery(b *testing.B) {
	testsvc.Firestore(b) // sets FIRESTORE_EMULATOR_HOST for the client
	client, err := firestore.NewClient(context.Background(), project)
	if err != nil {
		b.Fatal(err)
	}
	defer client.Close()
	doclocktest.BenchDelivery(b, driver{}, func(ctx context.Context, coll, key string) error { return naiveDelivery(ctx, client, coll, key) })
}

// BenchmarkCompleteTx measures a delivery that writes one document of its
// own (doclocktest.BenchCompleteTx).
func BenchmarkCompleteTx(b *testing.B) {
	doclocktest.BenchCompleteTx[*firestore.Transaction](b, driver{})
}
