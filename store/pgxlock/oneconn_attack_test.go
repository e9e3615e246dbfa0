package pgxlock_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// openConn opens one connection on dsn, closed when t ends.
func openConn(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

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
	b, table := newBackend(t, openConn(t, dsn))
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

// On a *pgx.Conn, a CompleteTx called inside another's body on the same
// backend (a LockTx nested in a LockTx) fails at once, saying why,
// rather than waiting forever for the connection the outer transaction
// holds; the outer one then commits as its body decides.
func TestOnOneConnNestedCompleteTxFailsAtOnce(t *testing.T) {
	ctx := t.Context()
	b, _ := newBackend(t, openConn(t, testsvc.Postgres(t)))
	outer, inner := won(t, b, "outer"), won(t, b, "inner")
	ok, err := b.CompleteTx(ctx, outer, "", func(ctx context.Context, tx pgx.Tx) error {
		ok, err := b.CompleteTx(ctx, inner, "", func(context.Context, pgx.Tx) error { return nil })
		if ok || err == nil || !strings.Contains(err.Error(), "inside a body") {
			return fmt.Errorf("the nested CompleteTx = %v, %v; want a refusal", ok, err)
		}
		return nil
	})
	if !ok || err != nil {
		t.Fatalf("the outer CompleteTx = %v, %v", ok, err)
	}
	if rec, _, err := b.Inspect(ctx, "inner"); rec.State != store.Claimed || err != nil {
		t.Errorf("the inner record: %+v, %v; want still Claimed", rec, err)
	}
}
