package firestorelock_test

import (
	"context"
	"log"
	"os"
	"time"

	"cloud.google.com/go/firestore"

	"github.com/GoogleCloudPlatform/functions-framework-go/functions"
	cloudevents "github.com/cloudevents/sdk-go/v2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
)

// The production set-up of a Pub/Sub-triggered Cloud Run function on a
// project whose default database is Firestore in Native mode: Dial finds
// the project, the emulator or the credentials in the environment.
func ExampleDial() {
	backend, err := firestorelock.Dial(context.Background(), "my-project",
		firestorelock.WithCollection("order_keys"))
	if err != nil {
		log.Fatal(err)
	}
	functions.CloudEvent("HandleOrder", idempotency.Idempotent(backend,
		idempotency.WithKey(idempotency.Attribute("po_id")),
	)(handleOrder))
}

// Backends on a connection the program already has (here one to the
// emulator), two collections sharing it. New does not dial, and a
// Backend's Close leaves the connection open.
func ExampleNew() {
	conn, err := grpc.NewClient(os.Getenv("FIRESTORE_EMULATOR_HOST"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	orders, err := firestorelock.New(conn, "my-project", firestorelock.WithCollection("order_keys"))
	if err != nil {
		log.Fatal(err)
	}
	invoices, err := firestorelock.New(conn, "my-project", firestorelock.WithCollection("invoice_keys"),
		firestorelock.WithDatabase("billing"))
	if err != nil {
		log.Fatal(err)
	}
	key := idempotency.WithKey(idempotency.Attribute("id"))
	functions.CloudEvent("HandleOrder", idempotency.Idempotent(orders, key)(handleOrder))
	functions.CloudEvent("HandleInvoice", idempotency.Idempotent(invoices, key)(handleInvoice))
}

func handleOrder(ctx context.Context, e cloudevents.Event) error   { return nil }
func handleInvoice(ctx context.Context, e cloudevents.Event) error { return nil }

// An order's document and the key's Done record commit in one
// transaction: a process that dies before the commit leaves neither, and
// a holder that was replaced commits nothing (false).
func ExampleBackend_CompleteTx() {
	ctx := context.Background()
	backend, err := firestorelock.Dial(ctx, "my-project")
	if err != nil {
		log.Fatal(err)
	}
	defer backend.Close()
	client, err := firestore.NewClient(ctx, "my-project")
	if err != nil {
		log.Fatal(err)
	}
	r, err := backend.Claim(ctx, "orders:42", time.Minute)
	if err != nil || r.Outcome != store.Won {
		return // a duplicate, or busy
	}
	done, err := backend.CompleteTx(ctx, r.Claim, "", func(ctx context.Context, tx *firestore.Transaction) error {
		// called again with a fresh tx when Firestore aborts it
		return tx.Create(client.Collection("orders").Doc("42"), map[string]any{"total": 1999})
	})
	if err != nil || !done {
		backend.Release(ctx, r.Claim) // not committed (or, with store.ErrCommitUnknown, unknown): a redelivery decides
	}
}
