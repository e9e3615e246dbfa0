package pgxlock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A LockTx whose pool is exhausted while its body runs (the body's
// transaction holds one connection, something else the other), so that
// its heartbeat's renewals wait for a connection, loses its lease on the
// server's clock; another delivery claims the key. The first delivery's
// transaction then commits nothing (its Done mark refused) and LockTx
// answers superseded, not nil: nothing acknowledged, no row written, the
// record the other delivery's.
func TestLockTxOnAnExhaustedPoolThatLosesItsLeaseCommitsNothing(t *testing.T) {
	dsn, clock := testsvc.PostgresOnFakeClock(t)
	ctx := t.Context()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	b, table := newBackend(t, pool)
	other := backendOn(t, dsn, table)
	s := newSink(t, openPool(t, dsn))
	const lease = 3 * time.Second
	var taken store.Claim
	err = idempotency.LockTx(ctx, b, "exhausted", func(ctx context.Context, tx pgx.Tx) error {
		hog, err := pool.Acquire(ctx)
		if err != nil {
			return err
		}
		defer hog.Release()
		// Renewals tick meanwhile, and wait for a connection (pgxpool
		// counts a waiting acquire only once it ends, so this waits ticks).
		time.Sleep(3 * idempotency.MinHeartbeat)
		clock.Jump(2 * lease)
		res, err := other.Claim(context.WithoutCancel(ctx), "exhausted", lease)
		if err != nil || res.Outcome != store.Won {
			return errors.New("the other delivery did not win the lapsed key")
		}
		taken = res.Claim
		return s.write(ctx, tx, "exhausted")
	}, idempotency.WithLease(lease), idempotency.WithHeartbeat(idempotency.MinHeartbeat))
	var ip *idempotency.InProgressError
	if !errors.As(err, &ip) || !ip.Superseded {
		t.Errorf("LockTx = %v; want superseded", err)
	}
	if n, err := s.count(ctx, "exhausted"); n != 0 || err != nil {
		t.Errorf("rows: %d, %v; want none", n, err)
	}
	rec, _, err := b.Inspect(ctx, "exhausted")
	if err != nil || rec.State != store.Claimed || rec.Fence != taken.Fence || rec.Version != store.VersionOf(taken.Token) {
		t.Errorf("the record: %+v, %v; want Claimed by the other delivery (fence %d)", rec, err, taken.Fence)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections still acquired", n)
	}
}
