package datastorelock_test

import (
	"context"
	"log"

	"github.com/GoogleCloudPlatform/functions-framework-go/functions"
	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
)

// The production set-up of a Pub/Sub-triggered Cloud Run function.
func ExampleNew() {
	backend, err := datastorelock.New(context.Background(), "my-project")
	if err != nil {
		log.Fatal(err)
	}
	functions.CloudEvent("HandleOrder", idempotency.Idempotent(backend,
		idempotency.WithKey(idempotency.Attribute("po_id")),
		idempotency.WithKeyPrefix("orders:"),
	)(handleOrder))
}

func handleOrder(ctx context.Context, e cloudevents.Event) error { return nil }
