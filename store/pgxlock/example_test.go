package pgxlock_test

import (
	"context"
	"log"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/pgxlock"
)

// Cloud SQL for PostgreSQL (or AlloyDB) through the service's own pgx
// pool: no database/sql, no second pool. On a table sqllock created, the
// same backend works with no migration.
func ExampleNew() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	backend, err := pgxlock.New(pool)
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

// An order's row, written on the pgx.Tx that also carries the key's Done
// mark: both commit together, or neither does.
func ExampleBackend_CompleteTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	backend, err := pgxlock.New(pool)
	if err != nil {
		log.Fatal(err)
	}
	r, err := backend.Claim(ctx, "orders:PO-1", time.Minute)
	if err != nil || r.Outcome != store.Won {
		return // a duplicate, another delivery at work, or an error: nack
	}
	ok, err := backend.CompleteTx(ctx, r.Claim, "", func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "INSERT INTO orders (id, total) VALUES ($1, $2)", "PO-1", 4200)
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
