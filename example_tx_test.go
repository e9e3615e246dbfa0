package idempotency_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
)

// orders is a stand-in for the caller's database: rows committed by
// transactions that buffer them. In production the transaction is the
// backend's own (sqllock's *sql.Tx, spannerlock's, datastorelock's or
// firestorelock's), and the rows live beside the idempotency records.
type orders struct{ rows []string }

type ordersTx struct {
	db   *orders
	rows []string
}

// A body whose effects are rows in the backend's own store commits them
// together with the done mark: a crash before the commit leaves neither,
// and a failure leaves nothing behind for the retry to trip over.
func ExampleLockTx() {
	db := &orders{}
	backend := fake.NewTx(fake.New(),
		func(context.Context) (*ordersTx, error) { return &ordersTx{db: db}, nil },
		func(tx *ordersTx) error { db.rows = append(db.rows, tx.rows...); return nil },
		func(*ordersTx) error { return nil })
	ctx := context.Background()

	attempt := 0
	for delivery := 1; delivery <= 3; delivery++ {
		err := idempotency.LockTx(ctx, backend, "orders:PO-1001", func(ctx context.Context, tx *ordersTx) error {
			attempt++
			tx.rows = append(tx.rows, "PO-1001 reserved")
			if attempt == 1 {
				return errors.New("the warehouse did not answer")
			}
			return nil
		})
		switch {
		case err == nil:
			fmt.Printf("delivery %d: committed, ack\n", delivery)
		case idempotency.IsOwnDuplicate(err, "orders:PO-1001"): // not errors.Is: see ErrDuplicate
			fmt.Printf("delivery %d: duplicate, ack\n", delivery)
		default:
			fmt.Printf("delivery %d: %v, nack\n", delivery, err)
		}
	}
	fmt.Println("rows:", db.rows)
	// Output:
	// delivery 1: the warehouse did not answer, nack
	// delivery 2: committed, ack
	// delivery 3: duplicate, ack
	// rows: [PO-1001 reserved]
}
