package pgxlock_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
)

// On a *pgx.Conn, a heartbeat's renewal already in flight when CompleteTx
// begins (the renewal's tick came first: between CompleteTx's attempts,
// or before the body started) must not share the connection with the
// transaction: Extend checks for a transaction only when it starts.
// CompleteTx should wait for the renewal, or fail saying why; here it
// sends its BEGIN on the connection the renewal is using, a data race
// on pgx's connection state (the race detector reports it); without the
// detector, pgx answers the BEGIN "conn busy" and closes the connection
// (Conn.BeginTx kills a connection whose BEGIN failed), under the
// renewal, so the backend's only connection is gone for every later
// delivery of the process.
func TestOnOneConnCompleteTxDoesNotOverlapARenewalInFlight(t *testing.T) {
	dsn := testsvc.Postgres(t)
	ctx := t.Context()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	b, table := newBackend(t, conn)
	c := won(t, b, "renewing")
	// Another session locks the record, so that the renewal waits on it.
	pool := openPool(t, dsn)
	overlapped := make(chan struct{})
	overlap := sync.OnceFunc(func() { close(overlapped) })
	lockTx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rolledBack := make(chan struct{})
	defer func() { overlap(); <-rolledBack }()
	go func() {
		defer close(rolledBack)
		// The renewal goes on once CompleteTx has had its chance to
		// overlap it.
		<-overlapped
		time.Sleep(100 * time.Millisecond)
		lockTx.Rollback(context.Background())
	}()
	if _, err := lockTx.Exec(ctx, `SELECT 1 FROM "`+table+`" FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	extended := make(chan error, 1)
	go func() {
		_, err := b.Extend(ctx, c, time.Minute)
		extended <- err
	}()
	waitFor(t, pool, `SELECT count(*) >= 1 FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted`)
	overlap()
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx pgx.Tx) error { return nil })
	if eerr := <-extended; eerr != nil {
		t.Errorf("the renewal: %v", eerr)
	}
	if !ok || err != nil {
		t.Errorf("CompleteTx beside a renewal in flight = %v, %v; want it to wait for the renewal, then commit", ok, err)
	}
	if res, err := b.Claim(ctx, "after", time.Minute); err != nil {
		t.Errorf("the next claim on the backend's connection: %v, %v", res, err)
	}
}
