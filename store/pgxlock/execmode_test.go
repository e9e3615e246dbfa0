package pgxlock_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// execModes are pgx's query exec modes other than its default
// (QueryExecModeCacheStatement): what a pool behind PgBouncer in
// transaction mode, or one told not to cache, runs its statements in.
var execModes = map[string]pgx.QueryExecMode{
	"CacheDescribe":  pgx.QueryExecModeCacheDescribe,
	"DescribeExec":   pgx.QueryExecModeDescribeExec,
	"Exec":           pgx.QueryExecModeExec,
	"SimpleProtocol": pgx.QueryExecModeSimpleProtocol,
}

// poolInMode opens a pool on dsn whose statements run in mode.
func poolInMode(t testing.TB, dsn string, mode pgx.QueryExecMode) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.DefaultQueryExecMode = mode
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// TestEveryQueryExecModeClaimsCompletesAndCompletesTx: each statement of
// the backend (bytea keys, int64 arguments, the transaction's marker,
// RETURNING scans) runs in every query exec mode a user may configure.
func TestEveryQueryExecModeClaimsCompletesAndCompletesTx(t *testing.T) {
	dsn := testsvc.Postgres(t)
	for name, mode := range execModes {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			b, _ := newBackend(t, poolInMode(t, dsn, mode))
			s := newSink(t, openPool(t, dsn))
			res, err := b.Claim(ctx, "k'\\x\xffkey", time.Minute)
			if err != nil || res.Outcome != store.Won {
				t.Fatalf("fresh claim: %+v, %v", res, err)
			}
			if again, err := b.Claim(ctx, "k'\\x\xffkey", time.Minute); err != nil || again.Outcome != store.HeldByOther {
				t.Fatalf("taken claim: %+v, %v", again, err)
			}
			if c, err := b.Extend(ctx, res.Claim, time.Minute); err != nil {
				t.Fatalf("extend: %v", err)
			} else {
				res.Claim = c
			}
			ok, err := b.CompleteTx(ctx, res.Claim, "fp", func(ctx context.Context, tx pgx.Tx) error { return s.write(ctx, tx, "k") })
			if !ok || err != nil {
				t.Fatalf("complete-tx: %v, %v", ok, err)
			}
			if n, err := s.count(ctx, "k"); n != 1 || err != nil {
				t.Fatalf("sink has %d rows, %v", n, err)
			}
			done, err := b.Claim(ctx, "k'\\x\xffkey", time.Minute)
			if err != nil || done.Outcome != store.AlreadyDone || done.Fingerprint != "fp" {
				t.Fatalf("done claim: %+v, %v", done, err)
			}
			r2, err := b.Claim(ctx, "k2", time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if ok, err := b.Complete(ctx, r2.Claim); !ok || err != nil {
				t.Fatalf("complete: %v, %v", ok, err)
			}
			r3, err := b.Claim(ctx, "k3", time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if err := b.Release(ctx, r3.Claim); err != nil {
				t.Fatalf("release: %v", err)
			}
			if _, err := b.PurgeExpired(ctx, 0); err != nil {
				t.Fatalf("purge: %v", err)
			}
			page, err := b.List(ctx, store.ListQuery{Prefix: "k"})
			if err != nil || len(page.Records) != 3 {
				t.Fatalf("list: %+v, %v", page, err)
			}
		})
	}
}
