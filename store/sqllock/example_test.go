package sqllock_test

import (
	"context"
	"database/sql"
	"log"
	"os"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// Cloud SQL for PostgreSQL (or AlloyDB) through pgx: the program also
// imports _ "github.com/jackc/pgx/v5/stdlib", which registers the driver
// "pgx". sqllock itself brings no driver.
func ExampleNew() {
	ctx := context.Background()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	backend, err := sqllock.New(db, sqllock.Postgres)
	if err != nil {
		log.Fatal(err)
	}
	if err := backend.EnsureSchema(ctx); err != nil {
		log.Fatal(err)
	}
	_ = idempotency.Lock(ctx, backend, "orders:PO-1", func(ctx context.Context) error {
		return nil // the side effect
	})
	// Now and then, as a cron job would:
	if _, err := backend.PurgeExpired(ctx, 10000); err != nil {
		log.Print(err)
	}
}

// An order's row and the key's Done mark commit together: a crash before
// the commit leaves neither, and a holder whose lease lapsed and whose key
// another delivery took cannot commit (false, its row rolled back).
func ExampleBackend_CompleteTx() {
	ctx := context.Background()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	backend, err := sqllock.New(db, sqllock.Postgres)
	if err != nil {
		log.Fatal(err)
	}
	r, err := backend.Claim(ctx, "orders:PO-1", time.Minute)
	if err != nil || r.Outcome != store.Won {
		return // a duplicate (AlreadyDone), another delivery at work (HeldByOther), or an error: nack
	}
	ok, err := backend.CompleteTx(ctx, r.Claim, "", func(ctx context.Context, tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, "INSERT INTO orders (id, total) VALUES ($1, $2)", "PO-1", 4200)
		return err
	})
	switch {
	case err != nil:
		// Nothing committed (or, wrapping store.ErrCommitUnknown, both or
		// neither): free the key for the redelivery.
		_ = backend.Release(ctx, r.Claim)
	case !ok:
		// Replaced: another delivery holds or finished the key; the row
		// was rolled back.
	}
}
