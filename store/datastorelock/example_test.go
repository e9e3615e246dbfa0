package datastorelock_test

import (
	"context"
	"log"
	"os"
	"time"

	"cloud.google.com/go/datastore"

	"github.com/GoogleCloudPlatform/functions-framework-go/functions"
	cloudevents "github.com/cloudevents/sdk-go/v2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
)

// The production set-up of a Pub/Sub-triggered Cloud Run function: Dial
// finds the project, the emulator or the credentials in the environment.
func ExampleDial() {
	backend, err := datastorelock.Dial(context.Background(), "my-project")
	if err != nil {
		log.Fatal(err)
	}
	functions.CloudEvent("HandleOrder", idempotency.Idempotent(backend,
		idempotency.WithKey(idempotency.Attribute("po_id")),
		idempotency.WithKeyPrefix("orders:"),
	)(handleOrder))
}

// Backends on a connection the program already has (here one to the
// emulator), two kinds of record sharing it. New does not dial, and a
// Backend's Close leaves the connection open: it lives as long as the
// program, whose code closes it after the Backends' last call.
func ExampleNew() {
	conn, err := grpc.NewClient(os.Getenv("DATASTORE_EMULATOR_HOST"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	orders, err := datastorelock.New(conn, "my-project", datastorelock.WithKind("OrderKey"))
	if err != nil {
		log.Fatal(err)
	}
	invoices, err := datastorelock.New(conn, "my-project", datastorelock.WithKind("InvoiceKey"))
	if err != nil {
		log.Fatal(err)
	}
	key := idempotency.WithKey(idempotency.Attribute("id"))
	functions.CloudEvent("HandleOrder", idempotency.Idempotent(orders, key)(handleOrder))
	functions.CloudEvent("HandleInvoice", idempotency.Idempotent(invoices, key)(handleInvoice))
}

func handleOrder(ctx context.Context, e cloudevents.Event) error   { return nil }
func handleInvoice(ctx context.Context, e cloudevents.Event) error { return nil }

// An order's entity and the key's Done record commit in one transaction:
// a process that dies before the commit leaves neither, and a holder that
// was replaced commits nothing (false).
func ExampleBackend_CompleteTx() {
	ctx := context.Background()
	backend, err := datastorelock.Dial(ctx, "my-project")
	if err != nil {
		log.Fatal(err)
	}
	defer backend.Close()
	r, err := backend.Claim(ctx, "orders:42", time.Minute)
	if err != nil || r.Outcome != store.Won {
		return // a duplicate, or busy
	}
	done, err := backend.CompleteTx(ctx, r.Claim, "", func(ctx context.Context, tx *datastore.Transaction) error {
		_, err := tx.Put(datastore.NameKey("Order", "42", nil), &struct{ Total int64 }{Total: 1999})
		return err // called again with a fresh tx when Datastore aborts it
	})
	if err != nil || !done {
		backend.Release(ctx, r.Claim) // not committed (or, with store.ErrCommitUnknown, unknown): a redelivery decides
	}
}
