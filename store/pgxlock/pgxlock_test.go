package pgxlock_test

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/txstorm"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/pgxlock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

func TestMain(m *testing.M) {
	flag.Parse()
	if txstorm.IsWorker() {
		// A storm's worker process gets its server's address from the
		// storm, and must start at once: starting a server of its own
		// here outlasted the storm's kills, and no order was ever acked.
		code := m.Run()
		os.Exit(code)
	}
	dsn, why := testsvc.Outside(testsvc.Postgres)
	switch {
	case why == "":
		exampleDSN = dsn
	case testsvc.Required():
		fmt.Fprintln(os.Stderr, "pgxlock's examples need PostgreSQL:", why)
		testsvc.StopAll()
		os.Exit(1)
	default:
		fmt.Fprintf(os.Stderr, "skipping %s: %s\n", serverExamples, why)
		skip := serverExamples
		if s := flag.Lookup("test.skip").Value.String(); s != "" {
			skip += "|" + s
		}
		flag.Set("test.skip", skip)
	}
	code := m.Run()
	testsvc.StopAll()
	os.Exit(code)
}

// openPool opens a pool on dsn, closed when t ends.
func openPool(t testing.TB, dsn string) *pgxpool.Pool {
	t.Helper()
	p, err := pgxpool.New(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// newBackend returns a backend on a table of its own, its schema made.
func newBackend(t testing.TB, db pgxlock.DB, opts ...pgxlock.Option) (*pgxlock.Backend, string) {
	t.Helper()
	table := fmt.Sprintf("t_%016x", rand.Uint64())
	b, err := pgxlock.New(db, append([]pgxlock.Option{pgxlock.WithTable(table)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.EnsureSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return b, table
}

// hostOf is the host:port of a postgres:// DSN.
func hostOf(dsn string) string {
	return dsn[strings.Index(dsn, "@")+1 : strings.LastIndex(dsn, "/")]
}

// harness is the contract suites' harness factory: a table per case, and a
// DropProxy per case between the backend's pool and the server as the
// Harness's Faults (arming it loses the next reply on any of the case's
// connections), so the suites check retry safety after lost replies and
// cut connections; the history case
// (concurrent_histories_are_linearizable_with_leases_that_lapse) then
// loses replies and cuts connections too. ServerClock runs the clock-jump
// cases on a server under libfaketime, one per case.
func harness(t *testing.T) func(t *testing.T) storetest.Harness {
	dsn := testsvc.Postgres(t)
	host := hostOf(dsn)
	return func(t *testing.T) storetest.Harness {
		const ttl = 2 * time.Second
		proxy := testsvc.NewDropProxy(t, host)
		pool := openPool(t, strings.Replace(dsn, host, proxy.Addr(), 1))
		b, table := newBackend(t, pool, pgxlock.WithTTL(ttl))
		return storetest.Harness{
			Backend: b, TTL: ttl, Step: 200 * time.Millisecond, Faults: proxy,
			// On the same table: a purge by either sees the other's records.
			WithTTL: func(ttl time.Duration) store.Backend {
				o, err := pgxlock.New(pool, pgxlock.WithTable(table), pgxlock.WithTTL(ttl))
				if err != nil {
					t.Fatal(err)
				}
				return o
			},
			ServerClock: func(t *testing.T) storetest.JumpHarness {
				dsn, clock := testsvc.PostgresOnFakeClock(t)
				b, _ := newBackend(t, openPool(t, dsn), pgxlock.WithTTL(ttl))
				return storetest.JumpHarness{
					Harness: storetest.Harness{Backend: b, TTL: ttl, Step: 200 * time.Millisecond, Now: clock.Now},
					Jump:    clock.Jump,
				}
			},
		}
	}
}

// TestContract runs the storetest suite on real PostgreSQL through a
// pgxpool.Pool.
func TestContract(t *testing.T) { storetest.Run(t, harness(t)) }

// TestOps runs the storetest suite of the operations interfaces
// (store.Operator) with the harness of TestContract.
func TestOps(t *testing.T) { storetest.RunOps(t, harness(t)) }

// sink is the body's own table, beside the backend's in one database.
type sink struct {
	table string
	pool  *pgxpool.Pool
}

func newSink(t testing.TB, pool *pgxpool.Pool) sink {
	t.Helper()
	s := sink{table: fmt.Sprintf("u_%016x", rand.Uint64()), pool: pool}
	if _, err := pool.Exec(context.Background(), "CREATE TABLE "+s.table+" (id VARCHAR(200) NOT NULL, n INTEGER NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return s
}

// write adds, in tx, one row carrying id.
func (s sink) write(ctx context.Context, tx pgx.Tx, id string) error {
	_, err := tx.Exec(ctx, "INSERT INTO "+s.table+" (id, n) VALUES ($1, 1)", id)
	return err
}

// read counts, in tx, the rows carrying id, locking them (FOR UPDATE).
func (s sink) read(ctx context.Context, tx pgx.Tx, id string) (int, error) {
	rows, err := tx.Query(ctx, "SELECT id FROM "+s.table+" WHERE id = $1 FOR UPDATE", id)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		n++
	}
	return n, rows.Err()
}

// count counts the committed rows carrying id, outside any transaction.
func (s sink) count(ctx context.Context, id string) (int, error) {
	var n int
	err := s.pool.QueryRow(ctx, "SELECT COUNT(*) FROM "+s.table+" WHERE id = $1", id).Scan(&n)
	return n, err
}

// endTx aborts tx the way PostgreSQL does on any failed statement.
func endTx(ctx context.Context, tx pgx.Tx) error {
	_, err := tx.Exec(ctx, "SELECT 1/0")
	return err
}

// TestTxContract runs the storetest suite's CompleteTx cases on real
// PostgreSQL, the body's rows in a table of their own in the same
// database, the backend behind a DropProxy per case; Count reads past it.
func TestTxContract(t *testing.T) {
	dsn := testsvc.Postgres(t)
	host := hostOf(dsn)
	direct := openPool(t, dsn)
	storetest.RunTx(t, func(t *testing.T) storetest.TxHarness[pgx.Tx] {
		const ttl = 2 * time.Second
		proxy := testsvc.NewDropProxy(t, host)
		pool := openPool(t, strings.Replace(dsn, host, proxy.Addr(), 1))
		b, _ := newBackend(t, pool, pgxlock.WithTTL(ttl))
		s := newSink(t, direct)
		return storetest.TxHarness[pgx.Tx]{
			Harness: storetest.Harness{Backend: b, TTL: ttl, Step: 200 * time.Millisecond, Faults: proxy},
			Retry:   &pgconn.PgError{Severity: "ERROR", Code: "40001", Message: "could not serialize access due to concurrent update"},
			Write:   s.write,
			Read:    s.read,
			Count:   s.count,
			EndTx:   endTx,
		}
	})
}

// txStorm runs the tx storm (internal/txstorm: worker processes killed
// at random, bodies killed in their commit window) on pgxlock, the sink
// in the same database as the backend's table.
func txStorm(t *testing.T, more func(*txstorm.Config[pgx.Tx])) txstorm.Figures {
	dsn, table, sinkTable := os.Getenv("TXSTORM_DSN"), os.Getenv("TXSTORM_TABLE"), os.Getenv("TXSTORM_SINK")
	if !txstorm.IsWorker() {
		dsn = testsvc.Postgres(t)
		suffix := fmt.Sprintf("%016x", rand.Uint64())
		table, sinkTable = "storm_"+suffix, "sink_"+suffix
		pool := openPool(t, dsn)
		b, err := pgxlock.New(pool, pgxlock.WithTable(table))
		if err != nil {
			t.Fatal(err)
		}
		if err := b.EnsureSchema(t.Context()); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(t.Context(), "CREATE TABLE "+sinkTable+" (id VARCHAR(200) NOT NULL, n INTEGER NOT NULL)"); err != nil {
			t.Fatal(err)
		}
	}
	var pool *pgxpool.Pool
	open := func(t testing.TB) *pgxpool.Pool {
		if pool == nil {
			pool = openPool(t, dsn)
		}
		return pool
	}
	cfg := txstorm.Config[pgx.Tx]{
		Env: []string{"TXSTORM_DSN=" + dsn, "TXSTORM_TABLE=" + table, "TXSTORM_SINK=" + sinkTable},
		Backend: func(t testing.TB) store.TxBackend[pgx.Tx] {
			b, err := pgxlock.New(open(t), pgxlock.WithTable(table))
			if err != nil {
				t.Fatal(err)
			}
			return b
		},
		Write: func(ctx context.Context, tx pgx.Tx, order string) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+sinkTable+" (id, n) VALUES ($1, 1)", order)
			return err
		},
		Count: func(ctx context.Context) (map[string]int, error) {
			rows, err := open(t).Query(ctx, "SELECT id, COUNT(*) FROM "+sinkTable+" GROUP BY id")
			if err != nil {
				return nil, err
			}
			defer rows.Close()
			m := map[string]int{}
			for rows.Next() {
				var id string
				var n int
				if err := rows.Scan(&id, &n); err != nil {
					return nil, err
				}
				m[id] = n
			}
			return m, rows.Err()
		},
	}
	if more != nil {
		more(&cfg)
	}
	return txstorm.Run(t, cfg)
}

// TestTxStorm: every order's row commits exactly once, with workers
// killed at random and in their commit window.
func TestTxStorm(t *testing.T) { txStorm(t, nil) }

// TestTxStormUnderAHeartbeatWithPanicsAndSwallowedEnds: the same, with
// lease renewals beside the bodies, bodies that panic, and bodies that
// swallow a failed statement that aborted their transaction.
func TestTxStormUnderAHeartbeatWithPanicsAndSwallowedEnds(t *testing.T) {
	txStorm(t, func(c *txstorm.Config[pgx.Tx]) {
		c.Orders = 150
		c.Lease = 2 * time.Second
		c.Heartbeat = 200 * time.Millisecond
		c.PanicRate, c.SwallowRate = 0.1, 0.1
		c.EndTx = endTx
	})
}
