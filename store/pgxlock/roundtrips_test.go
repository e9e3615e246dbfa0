package pgxlock_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
)

// countingConn counts the writes on a connection: pgx flushes what it
// sends once per round trip, in one write.
type countingConn struct {
	net.Conn
	writes *atomic.Int64
}

func (c countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// Steady state on pgx's statement cache: a fresh delivery through Lock is
// two round trips on the wire (the fresh insert, then Complete), a
// duplicate two (the fresh insert, then the full claim), and no statement
// is prepared again (a prepare, or a describe of
// QueryExecModeCacheDescribe, would be a write of its own).
func TestRoundTripsPerDelivery(t *testing.T) {
	cfg, err := pgxpool.ParseConfig(testsvc.Postgres(t))
	if err != nil {
		t.Fatal(err)
	}
	var writes atomic.Int64
	dial := cfg.ConnConfig.DialFunc
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return countingConn{c, &writes}, nil
	}
	// One connection, never pinged on acquire however long the machine
	// keeps the test from running.
	cfg.MaxConns, cfg.MinConns = 1, 1
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	b, _ := newBackend(t, pool)
	ctx := t.Context()
	noop := func(context.Context) error { return nil }
	// Prepare every statement of both paths on the connection.
	if err := idempotency.Lock(ctx, b, "warm", noop); err != nil {
		t.Fatal(err)
	}
	if err := idempotency.Lock(ctx, b, "warm", noop); !errors.Is(err, idempotency.ErrDuplicate) {
		t.Fatalf("a duplicate: %v, want ErrDuplicate", err)
	}
	writes.Store(0)
	for i := range 10 {
		if err := idempotency.Lock(ctx, b, fmt.Sprint("d", i), noop); err != nil {
			t.Fatal(err)
		}
	}
	if got := writes.Load(); got != 20 {
		t.Errorf("%d round trips for 10 fresh deliveries, want 2 each", got)
	}
	writes.Store(0)
	if err := idempotency.Lock(ctx, b, "d0", noop); !errors.Is(err, idempotency.ErrDuplicate) {
		t.Fatalf("a duplicate: %v, want ErrDuplicate", err)
	}
	if got := writes.Load(); got != 2 {
		t.Errorf("a duplicate took %d round trips, want 2", got)
	}
}
