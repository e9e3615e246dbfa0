// Package orderdb is what sqlc generates, in its pgx/v5 mode
// (sql_package: "pgx/v5"), for the queries below, written out by hand
// in that shape (db.go: DBTX, New, Queries, WithTx; query.sql.go: one
// method per query, its SQL in a constant), with doc comments added. The
// sqlc example of docs/effects.md (Example_sqlcQueriesInLockTx) uses it
// as a service uses its generated package.
//
//	-- name: InsertShipment :exec
//	INSERT INTO shipments (order_id, item) VALUES ($1, $2);
//
//	-- name: CountShipments :one
//	SELECT count(*) FROM shipments WHERE order_id = $1;
//
// on the table
//
//	CREATE TABLE shipments (order_id TEXT NOT NULL, item TEXT NOT NULL);
package orderdb

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DBTX is what the queries run on: a *pgxpool.Pool, a *pgx.Conn or a
// pgx.Tx.
type DBTX interface {
	Exec(context.Context, string, ...interface{}) (pgconn.CommandTag, error)
	Query(context.Context, string, ...interface{}) (pgx.Rows, error)
	QueryRow(context.Context, string, ...interface{}) pgx.Row
}

// New returns the queries on db.
func New(db DBTX) *Queries {
	return &Queries{db: db}
}

// Queries runs the generated queries.
type Queries struct {
	db DBTX
}

// WithTx returns the queries on tx.
func (q *Queries) WithTx(tx pgx.Tx) *Queries {
	return &Queries{
		db: tx,
	}
}
