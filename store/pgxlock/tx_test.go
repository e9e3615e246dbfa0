package pgxlock_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/pgxlock"
)

// won claims key on b and fails t unless it wins.
func won(t *testing.T, b store.Backend, key string) store.Claim {
	t.Helper()
	r, err := b.Claim(t.Context(), key, time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("Claim(%q) = %v, %v; want Won", key, r.Outcome, err)
	}
	return r.Claim
}

// Every way a body can end its own transaction and return nil gets an
// error and no Done mark: the record stays Claimed by c. The rows the body
// wrote before the end exist only after a COMMIT (statement or
// tx.Commit), and the error says so; otherwise nothing committed.
func TestCompleteTxBodyThatEndsItsTransactionGetsNoMark(t *testing.T) {
	pool := openPool(t, testsvc.Postgres(t))
	b, _ := newBackend(t, pool)
	s := newSink(t, pool)
	ways := []struct {
		name      string
		end       func(ctx context.Context, tx pgx.Tx) error
		committed bool
		says      string
	}{
		{"failed-statement", endTx, false, "nothing committed"},
		{"rollback-statement", func(ctx context.Context, tx pgx.Tx) error { _, err := tx.Exec(ctx, "ROLLBACK"); return err }, false, "after a ROLLBACK nothing committed"},
		{"commit-statement", func(ctx context.Context, tx pgx.Tx) error { _, err := tx.Exec(ctx, "COMMIT"); return err }, true, "after a COMMIT the body's writes before it exist without the mark"},
		{"tx.Rollback", func(ctx context.Context, tx pgx.Tx) error { return tx.Rollback(ctx) }, false, "did body commit or roll back tx?"},
		{"tx.Commit", func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) }, true, "did body commit or roll back tx?"},
	}
	for _, w := range ways {
		t.Run(w.name, func(t *testing.T) {
			ctx := t.Context()
			key := fmt.Sprintf("%s-%016x", w.name, rand.Uint64())
			c := won(t, b, key)
			ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx pgx.Tx) error {
				if err := s.write(ctx, tx, key); err != nil {
					return err
				}
				w.end(ctx, tx) // swallowed, as a careless body would
				return nil
			})
			if ok || err == nil || !strings.Contains(err.Error(), w.says) {
				t.Fatalf("CompleteTx = %v, %v; want an error saying %q", ok, err, w.says)
			}
			rec, found, err := b.Inspect(ctx, key)
			if err != nil || !found || rec.State != store.Claimed || rec.Fence != c.Fence {
				t.Fatalf("the record after the body ended its transaction: %+v, %v, %v; want still Claimed at fence %d", rec, found, err, c.Fence)
			}
			want := 0
			if w.committed {
				want = 1
			}
			if n, err := s.count(ctx, key); err != nil || n != want {
				t.Fatalf("the body's rows: %d, %v; want %d", n, err, want)
			}
		})
	}
}

// At REPEATABLE READ, a renewal of c's lease that commits after the
// body's first read fixed the transaction's snapshot makes the Done
// mark's UPDATE fail with 40001 in every attempt: CompleteTx returns an
// error wrapping ErrSnapshotConflict, and nothing commits.
func TestCompleteTxSnapshotConflictIsNamed(t *testing.T) {
	pool := openPool(t, testsvc.Postgres(t))
	b, _ := newBackend(t, pool, pgxlock.WithTxOptions(pgx.TxOptions{IsoLevel: pgx.RepeatableRead}), pgxlock.WithRetries(1))
	s := newSink(t, pool)
	ctx := t.Context()
	c := won(t, b, "renewed-under-the-body")
	calls := 0
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx pgx.Tx) error {
		calls++
		if _, err := s.read(ctx, tx, "renewed-under-the-body"); err != nil { // fixes the snapshot
			return err
		}
		if _, err := b.Extend(ctx, c, time.Minute); err != nil { // commits on another connection
			return err
		}
		return s.write(ctx, tx, "renewed-under-the-body")
	})
	if ok || !errors.Is(err, pgxlock.ErrSnapshotConflict) {
		t.Fatalf("CompleteTx = %v, %v; want an error wrapping ErrSnapshotConflict", ok, err)
	}
	if calls != 2 {
		t.Errorf("the body ran %d times; want 2 (WithRetries(1))", calls)
	}
	if n, err := s.count(ctx, "renewed-under-the-body"); err != nil || n != 0 {
		t.Fatalf("the body's rows: %d, %v; want none", n, err)
	}
}

// New refuses what it cannot honour, before any I/O.
func TestNewRefusesInvalidOptions(t *testing.T) {
	pool := openPool(t, "postgres://nobody@127.0.0.1:1/none") // never dialled
	var nilPool *pgxpool.Pool
	for name, c := range map[string]struct {
		db   pgxlock.DB
		opts []pgxlock.Option
		says string
	}{
		"nil-db":           {nil, nil, "nil DB"},
		"nil-pool":         {nilPool, nil, "nil *pgxpool.Pool"},
		"bad-table":        {pool, []pgxlock.Option{pgxlock.WithTable("a;b")}, "not a plain identifier"},
		"three-parts":      {pool, []pgxlock.Option{pgxlock.WithTable("a.b.c")}, "at most schema.table"},
		"zero-ttl":         {pool, []pgxlock.Option{pgxlock.WithTTL(0)}, "ttl"},
		"negative-retries": {pool, []pgxlock.Option{pgxlock.WithRetries(-1)}, "negative"},
		"read-only-tx":     {pool, []pgxlock.Option{pgxlock.WithTxOptions(pgx.TxOptions{AccessMode: pgx.ReadOnly})}, "read-only"},
		"unknown-level":    {pool, []pgxlock.Option{pgxlock.WithTxOptions(pgx.TxOptions{IsoLevel: "snapshot"})}, "no isolation level"},
	} {
		t.Run(name, func(t *testing.T) {
			b, err := pgxlock.New(c.db, c.opts...)
			if b != nil || err == nil || !strings.Contains(err.Error(), c.says) {
				t.Fatalf("New = %v, %v; want an error saying %q", b, err, c.says)
			}
		})
	}
}

// A backend on one *pgx.Conn claims, completes and runs CompleteTx; while
// a CompleteTx transaction holds that connection, Extend (a heartbeat's
// renewal) fails at once rather than waiting on, or interleaving with, the
// transaction's statements, and renews nothing.
func TestOnOneConnExtendDuringCompleteTxFailsAtOnce(t *testing.T) {
	ctx := t.Context()
	b, _ := newBackend(t, openConn(t, testsvc.Postgres(t)))
	c := won(t, b, "one-conn")
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx pgx.Tx) error {
		if _, err := b.Extend(ctx, c, time.Hour); err == nil || !strings.Contains(err.Error(), "cannot renew the lease now") {
			return fmt.Errorf("Extend on the conn the transaction holds: %v; want a refusal", err)
		}
		return nil
	})
	if err != nil || !ok {
		t.Fatalf("CompleteTx = %v, %v", ok, err)
	}
	rec, found, err := b.Inspect(ctx, "one-conn")
	if err != nil || !found || rec.State != store.Done || !rec.LeaseExpiry.Equal(c.LeaseExpiry) {
		t.Fatalf("the record: %+v, %v, %v; want Done with the lease it was claimed with (%v)", rec, found, err, c.LeaseExpiry)
	}
}
