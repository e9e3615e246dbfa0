package spannerlock_test

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"cloud.google.com/go/spanner"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/txstorm"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
)

// A crash storm on the Spanner emulator whose sink is a table in the same
// database as the records: workers deliver orders with LockTx while the
// storm SIGKILLs them, also between a body's write and its commit. Every
// order's row must exist exactly once.
func TestTxStorm(t *testing.T) {
	f := txStorm(t, false, nil)
	if !txstorm.IsWorker() {
		t.Logf("spannerlock storm: %v", f)
	}
}

// The storm again, with the features that meet a transactional body:
// every delivery under a heartbeat of 200ms (a renewal while the body's
// transaction is open: on the emulator it waits for the transaction),
// one body in ten panicking after its write, and one in ten swallowing
// the error of a statement after which the emulator holds its
// transaction failed (endTx). Every order's row must still exist exactly
// once.
func TestTxStormWithAHeartbeatPanicsAndEndedTransactions(t *testing.T) {
	f := txStorm(t, false, func(c *txstorm.Config[*spanner.ReadWriteTransaction]) {
		c.Heartbeat = 200 * time.Millisecond
		c.PanicRate = 0.1
		c.SwallowRate = 0.1
		c.EndTx = endTx
	})
	if !txstorm.IsWorker() {
		t.Logf("spannerlock storm with a heartbeat, panics and ended transactions: %v", f)
	}
}

// The storm tells a sink that writes outside the transaction (a separate
// transaction of its own, client.Apply): its rows commit even when the
// worker dies before the done mark, and the redelivery writes them again.
func TestTxStormCatchesWritesOutsideTheTransaction(t *testing.T) {
	if f := txStorm(t, true, nil); !txstorm.IsWorker() && f.Duplicated == 0 {
		t.Fatalf("the storm found nothing wrong with a sink that writes outside the transaction: %v", f)
	}
}

// The storm's sink: one new row per write, keyed (id, n) with n a fresh
// token, so that a second committed write of an order shows as a second
// row.
const (
	stormSink = "StormSink"
	stormDDL  = "CREATE TABLE " + stormSink + " (id STRING(64) NOT NULL, n STRING(64) NOT NULL) PRIMARY KEY (id, n)"
)

// The environment through which the storm tells its workers where the
// emulator and the database are: the workers must not start an emulator
// or create a database of their own.
const (
	stormHostEnv = "SPANNER_EMULATOR_HOST"
	stormDBEnv   = "TXSTORM_SPANNER_DB"
)

// txStorm runs the storm on a database of its own on the shared emulator;
// broken makes the sink write outside the body's transaction, and mix,
// when set, changes the storm's configuration.
//
// The emulator runs one read-write transaction at a time per database and
// aborts the others (the Spanner client runs them again): every Claim,
// body and Done mark of every worker queues on that one database, and a
// body that waits in the window holds it. The figures below keep the
// storm within about three minutes on a loaded two-core machine while it
// still kills workers mid-delivery and between a write and its commit:
// few workers (more only add aborts), a lease long enough that a claim
// outlives the aborts of its own body under that contention (a lease that
// lapses mid-body makes the Done mark fail its fence check: a nack and a
// redelivery, correct but slow), and kills spaced so that a restarted
// worker (a -race test binary and a new Spanner client) delivers a few
// orders before the next. Measured under -race on two cores: about 15-20 s
// at a load average of 10-17, about 100 s with six busy loops added.
func txStorm(t *testing.T, broken bool, mix func(*txstorm.Config[*spanner.ReadWriteTransaction])) txstorm.Figures {
	host, db := os.Getenv(stormHostEnv), os.Getenv(stormDBEnv)
	if !txstorm.IsWorker() {
		host = testsvc.Spanner(t)
		b, err := spannerlock.New(&spanner.Client{})
		if err != nil {
			t.Fatal(err)
		}
		db = testsvc.SpannerDatabase(t, b.Schema(), stormDDL)
	} else if host == "" || db == "" {
		t.Fatalf("a storm worker needs %s and %s", stormHostEnv, stormDBEnv)
	}
	var (
		mu     sync.Mutex
		client *spanner.Client
	)
	// open opens, once per process, the client the sink and the count
	// use (the backend has a client of its own, from Dial).
	open := func(t testing.TB) *spanner.Client {
		mu.Lock()
		defer mu.Unlock()
		if client == nil {
			c, err := spanner.NewClientWithConfig(context.Background(), db, spanner.ClientConfig{DisableNativeMetrics: true})
			if err != nil {
				t.Fatal(err)
			}
			client = c
			t.Cleanup(c.Close)
		}
		return client
	}
	run := txstorm.Run[*spanner.ReadWriteTransaction]
	if broken {
		run = txstorm.Storm[*spanner.ReadWriteTransaction]
	}
	cfg := txstorm.Config[*spanner.ReadWriteTransaction]{
		Orders:     80,
		Workers:    3,
		Lease:      2 * time.Second,
		WindowRate: 0.25,
		KillEvery:  700 * time.Millisecond,
		Timeout:    3 * time.Minute,
		Env:        []string{stormHostEnv + "=" + host, stormDBEnv + "=" + db},
		Backend: func(t testing.TB) store.TxBackend[*spanner.ReadWriteTransaction] {
			b, err := spannerlock.Dial(context.Background(), db)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { b.Close() })
			return b
		},
		Write: func(ctx context.Context, tx *spanner.ReadWriteTransaction, order string) error {
			if broken {
				// A transaction of its own, committed before the body
				// returns: under a context that is not the body's (the
				// Spanner client refuses a transaction nested in one).
				row := spanner.Insert(stormSink, []string{"id", "n"}, []any{order, store.NewToken()})
				_, err := open(t).Apply(context.Background(), []*spanner.Mutation{row})
				return err
			}
			// DML, not a buffered mutation: the write reaches the
			// server (and begins the transaction there) before the
			// body says it is at the window.
			_, err := tx.Update(ctx, spanner.Statement{
				SQL:    "INSERT INTO " + stormSink + " (id, n) VALUES (@id, @n)",
				Params: map[string]any{"id": order, "n": store.NewToken()},
			})
			return err
		},
		Count: func(ctx context.Context) (map[string]int, error) {
			m := map[string]int{}
			err := open(t).Single().Query(ctx, spanner.Statement{
				SQL: "SELECT id, COUNT(*) FROM " + stormSink + " GROUP BY id",
			}).Do(func(r *spanner.Row) error {
				var (
					id string
					n  int64
				)
				if err := r.Columns(&id, &n); err != nil {
					return err
				}
				m[id] = int(n)
				return nil
			})
			return m, err
		},
	}
	if mix != nil {
		mix(&cfg)
	}
	return run(t, cfg)
}
