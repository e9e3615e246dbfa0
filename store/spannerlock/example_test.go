package spannerlock_test

import (
	"context"
	"log"

	"cloud.google.com/go/spanner"
	"github.com/GoogleCloudPlatform/functions-framework-go/functions"
	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
)

const db = "projects/my-project/instances/my-instance/databases/my-database"

// The production set-up of a Pub/Sub-triggered Cloud Run function: Dial
// opens a client for the database (the emulator when
// SPANNER_EMULATOR_HOST is set), and EnsureSchema creates the table with
// its row deletion policy on first use.
func ExampleDial() {
	ctx := context.Background()
	backend, err := spannerlock.Dial(ctx, db)
	if err != nil {
		log.Fatal(err)
	}
	if err := backend.EnsureSchema(ctx, nil); err != nil {
		log.Fatal(err)
	}
	functions.CloudEvent("HandleOrder", idempotency.Idempotent(backend,
		idempotency.WithKey(idempotency.Attribute("po_id")),
		idempotency.WithKeyPrefix("orders:"),
	)(handleOrder))
}

// A Backend on the Spanner client the program already has. New sends
// nothing, and the Backend's Close leaves the client open.
func ExampleNew() {
	client, err := spanner.NewClient(context.Background(), db)
	if err != nil {
		log.Fatal(err)
	}
	backend, err := spannerlock.New(client, spannerlock.WithTable("OrderKeys"))
	if err != nil {
		log.Fatal(err)
	}
	functions.CloudEvent("HandleOrder", idempotency.Idempotent(backend,
		idempotency.WithKey(idempotency.Attribute("po_id")))(handleOrder))
}

func handleOrder(ctx context.Context, e cloudevents.Event) error { return nil }

// Effects in the same Spanner database, committed together with the done
// mark: LockTx (IdempotentTx for a CloudEvent function) runs the body in
// a read-write transaction of the backend's client, and the backend's
// CompleteTx marks the key done in that transaction before it commits.
// The body may run more than once (Spanner aborts, the client runs it
// again): only the attempt that commits leaves its writes.
func ExampleBackend_CompleteTx() {
	ctx := context.Background()
	backend, err := spannerlock.Dial(ctx, db)
	if err != nil {
		log.Fatal(err)
	}
	defer backend.Close()
	err = idempotency.LockTx(ctx, backend, "orders:po-1", func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
		return tx.BufferWrite([]*spanner.Mutation{
			spanner.Insert("Shipments", []string{"po_id", "state"}, []any{"po-1", "packed"}),
		})
	})
	if err != nil {
		log.Print(err) // not done: the delivery is nacked and comes again
	}

	functions.CloudEvent("HandleOrderTx", idempotency.IdempotentTx(backend,
		idempotency.WithKey(idempotency.Attribute("po_id")),
	)(func(ctx context.Context, e cloudevents.Event, tx *spanner.ReadWriteTransaction) error {
		return tx.BufferWrite([]*spanner.Mutation{
			spanner.Insert("Shipments", []string{"event_id", "state"}, []any{e.ID(), "packed"}),
		})
	}))
}
