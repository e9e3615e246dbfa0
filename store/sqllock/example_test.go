package sqllock_test

import (
	"context"
	"database/sql"
	"log"
	"os"

	"github.com/gcp-pubsub-idempotency/idempotency"
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
