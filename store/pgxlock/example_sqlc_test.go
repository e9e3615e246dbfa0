package pgxlock_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/pgxlock"
)

// DBTX, Queries, NewQueries and WithTx have the shape of the code sqlc
// generates in its pgx/v5 mode (sql_package: "pgx/v5") for these queries:
//
//	-- name: InsertShipment :exec
//	INSERT INTO shipments (order_id, item) VALUES ($1, $2);
//
//	-- name: CountShipments :one
//	SELECT count(*) FROM shipments WHERE order_id = $1;
type DBTX interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	Query(context.Context, string, ...any) (pgx.Rows, error)
	QueryRow(context.Context, string, ...any) pgx.Row
}

// Queries runs the generated queries on a pool, a connection or a pgx.Tx.
type Queries struct{ db DBTX }

// NewQueries is sqlc's New.
func NewQueries(db DBTX) *Queries { return &Queries{db: db} }

// WithTx runs the queries in tx.
func (q *Queries) WithTx(tx pgx.Tx) *Queries { return &Queries{db: tx} }

// InsertShipmentParams are InsertShipment's parameters.
type InsertShipmentParams struct{ OrderID, Item string }

// InsertShipment adds one shipment row.
func (q *Queries) InsertShipment(ctx context.Context, arg InsertShipmentParams) error {
	_, err := q.db.Exec(ctx, "INSERT INTO shipments (order_id, item) VALUES ($1, $2)", arg.OrderID, arg.Item)
	return err
}

// CountShipments counts an order's shipment rows.
func (q *Queries) CountShipments(ctx context.Context, orderID string) (int64, error) {
	var n int64
	err := q.db.QueryRow(ctx, "SELECT count(*) FROM shipments WHERE order_id = $1", orderID).Scan(&n)
	return n, err
}

// A handler whose effect is a row written through sqlc-generated queries:
// LockTx hands it the pgx.Tx that also marks the key done, and
// queries.WithTx(tx) puts the generated queries in it, so the row and the
// mark commit together. A failed attempt leaves no row, and a redelivery
// after the commit is a duplicate.
func Example_sqlcQueriesInLockTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, exampleDSN())
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
	queries := NewQueries(pool)

	attempts := 0
	ship := func(ctx context.Context, tx pgx.Tx) error {
		attempts++
		if err := queries.WithTx(tx).InsertShipment(ctx, InsertShipmentParams{OrderID: "PO-1", Item: "crate"}); err != nil {
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
	n, err := queries.CountShipments(ctx, "PO-1")
	fmt.Println("shipment rows:", n, err)
	// Output:
	// delivery 1: carrier API timed out, nack
	// delivery 2: committed, ack
	// delivery 3: duplicate, ack
	// shipment rows: 1 <nil>
}

// exampleDSN is the DSN of the test binary's shared PostgreSQL server
// (testsvc.Postgres), for the examples, which have no *testing.T.
func exampleDSN() string { return testsvc.Postgres(exampleTB{}) }

// exampleTB is the testing.TB that exampleDSN hands testsvc, which calls
// only Helper, Fatal, Fatalf and Skipf on it: an example that cannot get
// its server stops the test binary with the reason.
type exampleTB struct{ testing.TB }

func (exampleTB) Helper()                        {}
func (exampleTB) Fatal(args ...any)              { log.Fatal(args...) }
func (exampleTB) Fatalf(format string, a ...any) { log.Fatalf(format, a...) }
func (exampleTB) Skipf(format string, a ...any)  { log.Fatalf(format, a...) }
