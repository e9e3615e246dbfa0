package enginetest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// An order handler whose effect is a row in the same database as the
// idempotency records: LockTx hands it the transaction that also marks
// the key done, so the row and the mark commit together. A failed attempt
// leaves no row behind, and a redelivery after the commit is a duplicate.
// (docs/effects.md shows this example.)
func Example_lockTx() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "locktx")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "shop.db")+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)")
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec("CREATE TABLE shipments (order_id TEXT NOT NULL, item TEXT NOT NULL)"); err != nil {
		log.Fatal(err)
	}
	backend, err := sqllock.New(db, sqllock.SQLite)
	if err != nil {
		log.Fatal(err)
	}
	if err := backend.EnsureSchema(ctx); err != nil {
		log.Fatal(err)
	}

	attempts := 0
	ship := func(ctx context.Context, tx *sql.Tx) error {
		attempts++
		if _, err := tx.ExecContext(ctx, "INSERT INTO shipments (order_id, item) VALUES ('PO-1', 'crate')"); err != nil {
			return err
		}
		if attempts == 1 {
			return errors.New("carrier API timed out") // rolled back: no row stays
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
	var rows int
	db.QueryRow("SELECT COUNT(*) FROM shipments").Scan(&rows)
	fmt.Println("shipment rows:", rows)
	// Output:
	// delivery 1: carrier API timed out, nack
	// delivery 2: committed, ack
	// delivery 3: duplicate, ack
	// shipment rows: 1
}
