package firestorelock_test

import (
	"context"
	"os"
	"testing"
	"time"

	"cloud.google.com/go/firestore"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/txstorm"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
)

// A crash storm whose sink is a collection of the test's own in the
// records' database: worker processes deliver orders with LockTx under a
// heartbeat (200ms, a 2s lease), each body creating one new document in
// the transaction, and then sometimes panicking (10%) or making the store
// end its transaction and swallowing that (10%, endTx), while the storm
// SIGKILLs them, also between a body's write and its commit. Every order's
// document must exist exactly once.
func TestTxStorm(t *testing.T) { fsTxStorm(t, false) }

// The storm tells a sink that writes outside the transaction (a plain
// document Create): its documents commit even when the worker dies before
// the done mark, and the redelivery writes them again.
func TestTxStormCatchesWritesOutsideTheTransaction(t *testing.T) {
	if f := fsTxStorm(t, true); !txstorm.IsWorker() && f.Duplicated == 0 {
		t.Fatalf("the storm found nothing wrong with a sink that writes outside the transaction: %v", f)
	}
}

// fsTxStorm runs the storm; broken makes the sink write outside the
// body's transaction. The parent starts the emulator and names the
// records' and the sink's collections; the workers read them from the
// environment it passes.
func fsTxStorm(t *testing.T, broken bool) txstorm.Figures {
	addr, records, sinkColl := os.Getenv("FIRESTORE_EMULATOR_HOST"), os.Getenv("TXSTORM_COLLECTION"), os.Getenv("TXSTORM_SINK")
	if !txstorm.IsWorker() {
		addr = testsvc.Firestore(t)
		records, sinkColl = collection(), "sink_"+collection()
	}
	var client *firestore.Client
	open := func(t testing.TB) *firestore.Client {
		if client == nil {
			c, err := firestore.NewClient(context.Background(), project)
			if err != nil {
				t.Fatal(err)
			}
			client = c
		}
		return client
	}
	run := txstorm.Run[*firestore.Transaction]
	if broken {
		run = txstorm.Storm[*firestore.Transaction]
	}
	cfg := txstorm.Config[*firestore.Transaction]{
		Orders: 150, Workers: 4, Lease: 2 * time.Second, KillEvery: 800 * time.Millisecond, Timeout: 3 * time.Minute,
		Env: []string{"FIRESTORE_EMULATOR_HOST=" + addr, "TXSTORM_COLLECTION=" + records, "TXSTORM_SINK=" + sinkColl},
		Backend: func(t testing.TB) store.TxBackend[*firestore.Transaction] {
			b, err := firestorelock.Dial(context.Background(), project, firestorelock.WithCollection(records))
			if err != nil {
				t.Fatal(err)
			}
			return b
		},
		Write: func(ctx context.Context, tx *firestore.Transaction, order string) error {
			doc := open(t).Collection(sinkColl).NewDoc()
			if broken {
				_, err := doc.Create(ctx, map[string]any{"order": order})
				return err
			}
			return tx.Create(doc, map[string]any{"order": order})
		},
		Count: func(ctx context.Context) (map[string]int, error) {
			docs, err := open(t).Collection(sinkColl).Documents(ctx).GetAll()
			if err != nil {
				return nil, err
			}
			m := map[string]int{}
			for _, d := range docs {
				o, _ := d.Data()["order"].(string)
				m[o]++
			}
			return m, nil
		},
	}
	if !broken {
		cfg.Heartbeat, cfg.PanicRate, cfg.SwallowRate = 200*time.Millisecond, 0.1, 0.1
		cfg.EndTx = func(ctx context.Context, tx *firestore.Transaction) error {
			return endTx(open(t), open(t).Collection("locks_"+sinkColl))(ctx, tx)
		}
	}
	return run(t, cfg)
}
