package pgxlock_test

import (
	"context"
	"errors"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store/pgxlock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/pgxlock/internal/orderdb"
)

// A handler whose effect is a row written through sqlc-generated queries
// (package orderdb has the shape of sqlc's pgx/v5 output): LockTx hands
// it the pgx.Tx that also marks the key done, and queries.WithTx(tx) puts
// the generated queries in it, so the row and the mark commit together.
// A failed attempt leaves no row, and a redelivery after the commit is a
// duplicate.
func Example_sqlcQueriesInLockTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, exampleDSN)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, "DROP TABLE IF EXISTS shipments, sqlc_example_keys"); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE shipments (order_id TEXT NOT NULL, item TEXT NOT NULL)"); err != nil {
		log.Fatal(err)
	}
	backend, err := pgxlock.New(pool, pgxlock.WithTable("sqlc_example_keys"))
	if err != nil {
		log.Fatal(err)
	}
	if err := backend.EnsureSchema(ctx); err != nil {
		log.Fatal(err)
	}
	queries := orderdb.New(pool)

	attempts := 0
	ship := func(ctx context.Context, tx pgx.Tx) error {
		attempts++
		if err := queries.WithTx(tx).InsertShipment(ctx, orderdb.InsertShipmentParams{OrderID: "PO-1", Item: "crate"}); err != nil {
			return err
		}
		if attempts == 1 {
			return errors.New("reserving stock failed") // rolled back: no row stays
		}
		return nil
	}
	for delivery := 1; delivery <= 3; delivery++ {
		err := idempotency.LockTx(ctx, backend, "orders:PO-1", ship)
		switch {
		case err == nil:
			fmt.Printf("delivery %d: committed, ack\n", delivery)
		case errors.Is(err, idempotency.ErrDuplicate):
			fmt.Printf("delivery %d: duplicate, ack\n", delivery)
		default:
			fmt.Printf("delivery %d: %v, nack\n", delivery, err)
		}
	}
	n, err := queries.CountShipments(ctx, "PO-1")
	fmt.Println("shipment rows:", n, err)
	// Output:
	// delivery 1: reserving stock failed, nack
	// delivery 2: committed, ack
	// delivery 3: duplicate, ack
	// shipment rows: 1 <nil>
}

// exampleDSN is the DSN of the test binary's shared PostgreSQL server,
// which TestMain prepared for the examples (they have no *testing.T).
var exampleDSN string

// serverExamples are the examples that need PostgreSQL: TestMain skips
// them, saying why, when it cannot have the server and the run does not
// require it (testsvc.Required).
const serverExamples = "^Example_sqlcQueriesInLockTx$"
