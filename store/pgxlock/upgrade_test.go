package pgxlock_test

import (
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

// A connection that cached the backend's statements on a table without
// the fingerprint column (one sqllock created before it existed) goes on
// working after EnsureSchema adds the column under it: the statements
// that named the column failed before the upgrade and were never cached,
// and the cached ones keep their result types ("cached plan must not
// change result type" never reaches the caller), in every exec mode that
// caches.
func TestStatementsCachedBeforeTheFingerprintUpgradeStillWork(t *testing.T) {
	dsn := testsvc.Postgres(t)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe} {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := t.Context()
			cfg, err := pgxpool.ParseConfig(dsn)
			if err != nil {
				t.Fatal(err)
			}
			cfg.MaxConns = 1 // one connection: every statement's cache entry is on it
			cfg.ConnConfig.DefaultQueryExecMode = mode
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			table := fmt.Sprintf("old_%016x", rand.Uint64())
			b, err := pgxlock.New(pool, pgxlock.WithTable(table))
			if err != nil {
				t.Fatal(err)
			}
			old := strings.Replace(b.Schema(), ",\n\tfingerprint     TEXT", "", 1)
			if old == b.Schema() {
				t.Fatalf("cannot drop the fingerprint column from %s", b.Schema())
			}
			if _, err := pool.Exec(ctx, strings.Split(old, ";")[0]); err != nil {
				t.Fatal(err)
			}
			c := store.Claim{Key: "k", Fence: 1, Token: "t"}
			if _, err := pool.Exec(ctx, `INSERT INTO "`+table+`" VALUES ('\x6b', 1, 1, 0, 0, 't')`); err != nil {
				t.Fatal(err)
			}
			// Cached on the old table: statements that do not name the column.
			if _, err := b.Extend(ctx, c, time.Minute); err != nil {
				t.Fatalf("extend on the old table: %v", err)
			}
			if _, err := b.PurgeExpired(ctx, 0); err != nil {
				t.Fatalf("purge on the old table: %v", err)
			}
			if _, err := b.Claim(ctx, "k2", time.Minute); err == nil || !strings.Contains(err.Error(), "call EnsureSchema") {
				t.Fatalf("claim on the old table: %v; want the upgrade explained", err)
			}
			if err := b.EnsureSchema(ctx); err != nil {
				t.Fatal(err)
			}
			if ok, err := b.CompleteFingerprint(ctx, c, "fp"); !ok || err != nil {
				t.Fatalf("complete after the upgrade: %v, %v", ok, err)
			}
			res, err := b.Claim(ctx, "k", time.Minute)
			if err != nil || res.Outcome != store.AlreadyDone || res.Fingerprint != "fp" {
				t.Fatalf("claim after the upgrade: %+v, %v", res, err)
			}
			r2, err := b.Claim(ctx, "k2", time.Minute)
			if err != nil || r2.Outcome != store.Won {
				t.Fatalf("fresh claim after the upgrade: %+v, %v", r2, err)
			}
			if _, err := b.Extend(ctx, r2.Claim, time.Minute); err != nil {
				t.Fatalf("extend after the upgrade: %v", err)
			}
			if _, err := b.PurgeExpired(ctx, 0); err != nil {
				t.Fatalf("purge after the upgrade: %v", err)
			}
			if err := b.Release(ctx, r2.Claim); err != nil {
				t.Fatalf("release after the upgrade: %v", err)
			}
			if page, err := b.List(ctx, store.ListQuery{}); err != nil || len(page.Records) != 2 {
				t.Fatalf("list after the upgrade: %+v, %v", page, err)
			}
		})
	}
}
