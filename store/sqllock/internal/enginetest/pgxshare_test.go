package enginetest

import (
	"database/sql"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/pgxlock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// One table, two backends: a record written by sqllock (PostgreSQL
// dialect, database/sql) is read, claimed, completed and listed by
// pgxlock, and one written by pgxlock by sqllock, with no migration: the
// table sqllock's EnsureSchema made is the one pgxlock's would make
// (EnsureSchema changes nothing on it), the fingerprint column's stamps
// read the same both ways, and a listing's cursor carries over.
func TestSharesTheTableWithSqllock(t *testing.T) {
	dsn := testsvc.Postgres(t)
	ctx := t.Context()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	const ttl = 2 * time.Second
	table := fmt.Sprintf("t_%016x", rand.Uint64())
	px, err := pgxlock.New(pool, pgxlock.WithTable(table), pgxlock.WithTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
	db := sql.OpenDB(stdlib.GetPoolConnector(pool))
	t.Cleanup(func() { db.Close() })
	sq, err := sqllock.New(db, sqllock.Postgres, sqllock.WithTable(table), sqllock.WithTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
	if sq.Schema() != px.Schema() || sq.UpgradeSchema() != px.UpgradeSchema() {
		t.Fatalf("the two backends' DDL differ:\nsqllock: %s\npgxlock: %s", sq.Schema(), px.Schema())
	}
	if err := sq.EnsureSchema(ctx); err != nil {
		t.Fatal(err)
	}
	if err := px.EnsureSchema(ctx); err != nil {
		t.Fatalf("pgxlock's EnsureSchema on sqllock's table: %v", err)
	}

	claim := func(b store.Backend, key string, lease time.Duration, want store.Outcome) store.Result {
		t.Helper()
		r, err := b.Claim(ctx, key, lease)
		if err != nil || r.Outcome != want {
			t.Fatalf("%T.Claim(%q) = %v, %v; want %v", b, key, r.Outcome, err, want)
		}
		return r
	}

	// sqllock completes with a fingerprint; pgxlock sees the duplicate
	// and the fingerprint, and so does Inspect.
	r := claim(sq, "done-by-sqllock", time.Minute, store.Won)
	if ok, err := sq.CompleteFingerprint(ctx, r.Claim, "fp-1"); err != nil || !ok {
		t.Fatalf("sqllock CompleteFingerprint = %v, %v", ok, err)
	}
	if got := claim(px, "done-by-sqllock", time.Minute, store.AlreadyDone); got.Fingerprint != "fp-1" {
		t.Fatalf("pgxlock read fingerprint %q of sqllock's record, want fp-1", got.Fingerprint)
	}
	if rec, ok, err := px.Inspect(ctx, "done-by-sqllock"); err != nil || !ok || rec.State != store.Done || rec.Fence != 1 || rec.Fingerprint != "fp-1" {
		t.Fatalf("pgxlock Inspect = %+v, %v, %v", rec, ok, err)
	}

	// pgxlock holds a key; sqllock is refused it, and after pgxlock's
	// release (which raises the fence) wins it with the fence after that;
	// pgxlock then sees it done.
	held := claim(px, "held-by-pgxlock", time.Minute, store.Won)
	claim(sq, "held-by-pgxlock", time.Minute, store.HeldByOther)
	if err := px.Release(ctx, held.Claim); err != nil {
		t.Fatal(err)
	}
	next := claim(sq, "held-by-pgxlock", time.Minute, store.Won)
	if next.Claim.Fence != held.Claim.Fence+2 {
		t.Fatalf("sqllock won fence %d after pgxlock released fence %d", next.Claim.Fence, held.Claim.Fence)
	}
	if ok, err := sq.Complete(ctx, next.Claim); err != nil || !ok {
		t.Fatalf("sqllock Complete = %v, %v", ok, err)
	}
	claim(px, "held-by-pgxlock", time.Minute, store.AlreadyDone)

	// A lease sqllock won lapses; pgxlock reclaims it, and sqllock's
	// late Complete is fenced out while pgxlock's lands.
	lapsed := claim(sq, "lapsed", 300*time.Millisecond, store.Won)
	time.Sleep(500 * time.Millisecond)
	re := claim(px, "lapsed", time.Minute, store.Won)
	if ok, err := sq.Complete(ctx, lapsed.Claim); err != nil || ok {
		t.Fatalf("sqllock's Complete of a lapsed claim = %v, %v; want false", ok, err)
	}
	if ok, err := px.CompleteFingerprint(ctx, re.Claim, "fp-2"); err != nil || !ok {
		t.Fatalf("pgxlock CompleteFingerprint = %v, %v", ok, err)
	}
	if got := claim(sq, "lapsed", time.Minute, store.AlreadyDone); got.Fingerprint != "fp-2" {
		t.Fatalf("sqllock read fingerprint %q of pgxlock's record, want fp-2", got.Fingerprint)
	}

	// Each lists the other's records, and continues the other's listing
	// from its cursor.
	for _, pair := range [][2]store.Lister{{sq, px}, {px, sq}} {
		first, err := pair[0].List(ctx, store.ListQuery{State: store.Done, Limit: 1})
		if err != nil || len(first.Records) != 1 || first.Next == "" {
			t.Fatalf("%T List, limit 1 = %+v, %v", pair[0], first, err)
		}
		rest, err := pair[1].List(ctx, store.ListQuery{State: store.Done, Cursor: first.Next})
		if err != nil || len(rest.Records) != 2 || rest.Next != "" {
			t.Fatalf("%T List from %T's cursor = %+v, %v; want the other 2 records", pair[1], pair[0], rest, err)
		}
	}
}
