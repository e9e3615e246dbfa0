package enginetest

import (
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// The statements name derived tables and CTEs (PostgreSQL's clock, up and
// c; the list's w): a table with one of those names, which WithTable
// accepts, must work with every verb. (On PostgreSQL a table named c
// failed Release and Extend, "table name "c" specified more than once";
// one named clock or up failed every Claim of a taken key, its read of
// the record resolving to the CTE; on SQLite a table named w failed List,
// "circular reference".)
func TestEveryVerbOnATableNamedLikeAnAliasOfTheStatements(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db := e.open(t, e.dsn(t), nil)
		ctx := t.Context()
		for _, name := range []string{"c", "clock", "up", "t", "r", "w", "f", "excluded", "EXCLUDED"} {
			b, err := sqllock.New(db, e.dialect, sqllock.WithTable(name))
			if err != nil {
				t.Fatal(err)
			}
			db.ExecContext(ctx, "DROP TABLE IF EXISTS "+e.sql().Quote(name))
			if err := b.EnsureSchema(ctx); err != nil {
				t.Errorf("%s: ensure: %v", name, err)
				continue
			}
			// A fresh claim, then a claim of the taken key.
			r, err := b.Claim(ctx, "k", time.Minute)
			if err != nil || r.Outcome != store.Won {
				t.Errorf("%s: fresh claim %v %v", name, r.Outcome, err)
				continue
			}
			if d, err := b.Claim(ctx, "k", time.Minute); err != nil || d.Outcome != store.HeldByOther {
				t.Errorf("%s: dup claim %v %v", name, d.Outcome, err)
			}
			if _, err := b.Extend(ctx, r.Claim, time.Minute); err != nil {
				t.Errorf("%s: extend %v", name, err)
			}
			if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
				t.Errorf("%s: complete %v %v", name, ok, err)
			}
			r2, err := b.Claim(ctx, "k2", time.Minute)
			if err != nil {
				t.Errorf("%s: claim k2 %v", name, err)
			} else if err := b.Release(ctx, r2.Claim); err != nil {
				t.Errorf("%s: release %v", name, err)
			}
			if _, err := b.PurgeExpired(ctx, 0); err != nil {
				t.Errorf("%s: purge %v", name, err)
			}
			if _, err := b.List(ctx, store.ListQuery{}); err != nil {
				t.Errorf("%s: list %v", name, err)
			}
			b.Close()
			db.ExecContext(ctx, "DROP TABLE IF EXISTS "+e.sql().Quote(name))
		}
	})
}
