package pgxlock_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Bodies that use the transaction the ordinary ways pgx offers beyond
// plain statements get their mark: savepoints (pgx's nested transactions)
// committed or rolled back, a failed statement recovered from by rolling
// back its savepoint, and statements run on tx.Conn(). What the body
// kept commits with the mark; what it rolled back to a savepoint does
// not.
func TestCompleteTxBodyWithSavepointsAndTheConnGetsItsMark(t *testing.T) {
	pool := openPool(t, testsvc.Postgres(t))
	b, _ := newBackend(t, pool)
	s := newSink(t, pool)
	if _, err := pool.Exec(t.Context(), "CREATE UNIQUE INDEX ON "+s.table+" (id)"); err != nil {
		t.Fatal(err)
	}
	ways := []struct {
		name string
		body func(ctx context.Context, tx pgx.Tx, id string) error
		kept int
	}{
		{"savepoint committed", func(ctx context.Context, tx pgx.Tx, id string) error {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if err := s.write(ctx, sp, id); err != nil {
				return err
			}
			return sp.Commit(ctx)
		}, 1},
		{"savepoint rolled back", func(ctx context.Context, tx pgx.Tx, id string) error {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if err := s.write(ctx, sp, id); err != nil {
				return err
			}
			return sp.Rollback(ctx)
		}, 0},
		{"failed statement rolled back to its savepoint", func(ctx context.Context, tx pgx.Tx, id string) error {
			if err := s.write(ctx, tx, id); err != nil {
				return err
			}
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			var pg *pgconn.PgError
			if err := s.write(ctx, sp, id); !errors.As(err, &pg) || pg.Code != "23505" {
				return errors.New("the duplicate row was not refused")
			}
			return sp.Rollback(ctx)
		}, 1},
		{"statement on tx.Conn()", func(ctx context.Context, tx pgx.Tx, id string) error {
			_, err := tx.Conn().Exec(ctx, "INSERT INTO "+s.table+" (id, n) VALUES ($1, 1)", id)
			return err
		}, 1},
	}
	for _, w := range ways {
		t.Run(w.name, func(t *testing.T) {
			ctx := t.Context()
			c := won(t, b, w.name)
			ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx pgx.Tx) error { return w.body(ctx, tx, w.name) })
			if !ok || err != nil {
				t.Fatalf("CompleteTx = %v, %v; want true, nil", ok, err)
			}
			if n, err := s.count(ctx, w.name); n != w.kept || err != nil {
				t.Errorf("the body's rows: %d, %v; want %d", n, err, w.kept)
			}
			if rec, _, err := b.Inspect(ctx, w.name); rec.State != store.Done || err != nil {
				t.Errorf("the record: %+v, %v; want Done", rec, err)
			}
		})
	}
}

// A body that leaves a query's rows open, returning nil or panicking,
// gets no mark and holds no connection afterwards: nothing committed,
// the record stays Claimed by c, and the pool has every connection back.
func TestCompleteTxBodyLeavingRowsOpenLeaksNothing(t *testing.T) {
	pool := openPool(t, testsvc.Postgres(t))
	b, _ := newBackend(t, pool)
	s := newSink(t, pool)
	for _, panics := range []bool{false, true} {
		name := map[bool]string{false: "returns nil", true: "panics"}[panics]
		t.Run(name, func(t *testing.T) {
			ctx := t.Context()
			c := won(t, b, name)
			var ok bool
			var err error
			func() {
				defer func() {
					if r := recover(); (r != nil) != panics {
						t.Errorf("recovered %v", r)
					}
				}()
				ok, err = b.CompleteTx(ctx, c, "", func(ctx context.Context, tx pgx.Tx) error {
					if err := s.write(ctx, tx, name); err != nil {
						return err
					}
					rows, err := tx.Query(ctx, "SELECT generate_series(1, 100000)")
					if err != nil {
						return err
					}
					rows.Next()
					if panics {
						panic("with rows open")
					}
					return nil
				})
			}()
			if ok || (!panics && err == nil) {
				t.Errorf("CompleteTx = %v, %v; want false and an error", ok, err)
			}
			if n, err := s.count(ctx, name); n != 0 || err != nil {
				t.Errorf("the body's rows: %d, %v; want none", n, err)
			}
			if rec, _, err := b.Inspect(ctx, name); rec.State != store.Claimed || rec.Fence != c.Fence || err != nil {
				t.Errorf("the record: %+v, %v; want still Claimed by fence %d", rec, err, c.Fence)
			}
			if n := pool.Stat().AcquiredConns(); n != 0 {
				t.Errorf("%d connections still acquired", n)
			}
		})
	}
}
