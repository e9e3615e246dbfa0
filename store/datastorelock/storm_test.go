package datastorelock_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"cloud.google.com/go/datastore"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/txstorm"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
)

// A crash storm whose sink is a kind of the test's own in the records'
// database: worker processes deliver orders with LockTx under a heartbeat
// (200ms, a 2s lease), each body putting one new entity (an incomplete
// key) in the transaction, and then sometimes panicking (10%) or making
// the store end its transaction and swallowing that (10%, endTx), while
// the storm SIGKILLs them, also between a body's write and its commit.
// Every order's entity must exist exactly once.
func TestTxStorm(t *testing.T) { dsTxStorm(t, false) }

// The storm tells a sink that writes outside the transaction (a plain
// client Put): its entities commit even when the worker dies before the
// done mark, and the redelivery writes them again.
func TestTxStormCatchesWritesOutsideTheTransaction(t *testing.T) {
	if f := dsTxStorm(t, true); !txstorm.IsWorker() && f.Duplicated == 0 {
		t.Fatalf("the storm found nothing wrong with a sink that writes outside the transaction: %v", f)
	}
}

// sinkEntity is one order's effect.
type sinkEntity struct{ Order string }

// dsTxStorm runs the storm; broken makes the sink write outside the
// body's transaction. The parent starts the emulator and names the
// namespace and the sink's kind; the workers read them from the
// environment it passes.
func dsTxStorm(t *testing.T, broken bool) txstorm.Figures {
	addr, ns, kind := os.Getenv("DATASTORE_EMULATOR_HOST"), os.Getenv("TXSTORM_NAMESPACE"), os.Getenv("TXSTORM_KIND")
	if !txstorm.IsWorker() {
		addr = testsvc.Datastore(t)
		ns, kind = namespace(), fmt.Sprintf("Sink%016x", rand.Uint64())
	}
	var client *datastore.Client
	open := func(t testing.TB) *datastore.Client {
		if client == nil {
			c, err := datastore.NewClient(context.Background(), project)
			if err != nil {
				t.Fatal(err)
			}
			client = c
		}
		return client
	}
	key := func() *datastore.Key {
		k := datastore.IncompleteKey(kind, nil)
		k.Namespace = ns
		return k
	}
	run := txstorm.Run[*datastore.Transaction]
	if broken {
		run = txstorm.Storm[*datastore.Transaction]
	}
	cfg := txstorm.Config[*datastore.Transaction]{
		Orders: 200, Workers: 4, Lease: 2 * time.Second, KillEvery: 600 * time.Millisecond, Timeout: 3 * time.Minute,
		Env: []string{"DATASTORE_EMULATOR_HOST=" + addr, "TXSTORM_NAMESPACE=" + ns, "TXSTORM_KIND=" + kind},
		Backend: func(t testing.TB) store.TxBackend[*datastore.Transaction] {
			b, err := datastorelock.Dial(context.Background(), project, datastorelock.WithNamespace(ns))
			if err != nil {
				t.Fatal(err)
			}
			return b
		},
		Write: func(ctx context.Context, tx *datastore.Transaction, order string) error {
			if broken {
				_, err := open(t).Put(ctx, key(), &sinkEntity{Order: order})
				return err
			}
			_, err := tx.Put(key(), &sinkEntity{Order: order})
			return err
		},
		Count: func(ctx context.Context) (map[string]int, error) {
			var es []sinkEntity
			if _, err := open(t).GetAll(ctx, datastore.NewQuery(kind).Namespace(ns), &es); err != nil {
				return nil, err
			}
			m := map[string]int{}
			for _, e := range es {
				m[e.Order]++
			}
			return m, nil
		},
	}
	if !broken {
		cfg.Heartbeat, cfg.PanicRate, cfg.SwallowRate = 200*time.Millisecond, 0.1, 0.1
		cfg.EndTx = func(ctx context.Context, tx *datastore.Transaction) error { return endTx(open(t), ns)(ctx, tx) }
	}
	return run(t, cfg)
}
