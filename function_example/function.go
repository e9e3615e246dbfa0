// Package function is a deployable Cloud Run function (gen2) for the
// example in package orders. Its init registers two CloudEvent functions
// with the functions framework:
//
//	HandleOrder          orders from a Pub/Sub topic, each sent to the supplier once
//	HandleStatusUpdate   status updates, every one applied, never two at once per order
//
// See package orders for the configuration: on Cloud Run the instance
// refuses to start rather than guard with a store of its own. Deploy it
// from the directory `make function-source` writes (this package, a go.mod
// of its own and a vendor directory); the README has the commands.
package function

import (
	"context"
	"log"
	"log/slog"
	"os"

	"github.com/GoogleCloudPlatform/functions-framework-go/functions"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/function_example/orders"
)

func init() {
	if os.Getenv("K_SERVICE") != "" {
		// On Cloud Run, log JSON that Cloud Logging reads severities from.
		slog.SetDefault(slog.New(idempotency.NewLogHandler(os.Stderr, nil)))
	}
	backend, lease, err := orders.Setup(context.Background())
	if err != nil {
		// Fail the instance's start-up: serving without a guard would
		// repeat side effects.
		log.Fatal(err)
	}
	for name, fn := range orders.Functions(backend, lease) {
		functions.CloudEvent(name, fn)
	}
}
