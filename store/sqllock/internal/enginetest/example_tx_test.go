package enginetest

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	_ "modernc.org/sqlite" // registers the driver "sqlite"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// CompleteTx on SQLite, run: the order's row and the Done mark commit
// together; a second delivery of the key is a duplicate, and a holder
// replaced after its lease lapsed commits nothing.
func Example_completeTx() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "completetx")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "shop.db")+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)")
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)"); err != nil {
		log.Fatal(err)
	}
	backend, err := sqllock.New(db, sqllock.SQLite)
	if err != nil {
		log.Fatal(err)
	}
	if err := backend.EnsureSchema(ctx); err != nil {
		log.Fatal(err)
	}
	insert := func(id string) func(ctx context.Context, tx *sql.Tx) error {
		return func(ctx context.Context, tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, "INSERT INTO orders (id, total) VALUES (?, 4200)", id)
			return err
		}
	}

	r, _ := backend.Claim(ctx, "orders:PO-1", time.Minute)
	ok, err := backend.CompleteTx(ctx, r.Claim, "", insert("PO-1"))
	fmt.Println("first delivery committed:", ok, err)
	again, _ := backend.Claim(ctx, "orders:PO-1", time.Minute)
	fmt.Println("redelivery:", again.Outcome == store.AlreadyDone)

	// A holder whose lease lapsed, and whose key another delivery took.
	old, _ := backend.Claim(ctx, "orders:PO-2", time.Millisecond)
	time.Sleep(5 * time.Millisecond)
	next, _ := backend.Claim(ctx, "orders:PO-2", time.Minute)
	ok, err = backend.CompleteTx(ctx, old.Claim, "", insert("PO-2"))
	fmt.Println("replaced holder committed:", ok, err)
	ok, err = backend.CompleteTx(ctx, next.Claim, "", insert("PO-2"))
	fmt.Println("its successor committed:", ok, err)

	var n int
	if err := db.QueryRow("SELECT COUNT(*) FROM orders").Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("orders:", n)
	// Output:
	// first delivery committed: true <nil>
	// redelivery: true
	// replaced holder committed: false <nil>
	// its successor committed: true <nil>
	// orders: 2
}
