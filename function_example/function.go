// Package function is a deployable Cloud Run function (gen2) that hands
// orders arriving on a Pub/Sub topic to a supplier, once each.
//
// It registers HandleOrder with the functions framework. Each delivery is
// guarded by idempotency.Idempotent, keyed by the order id (the message
// attribute po_id), so a redelivery, a second subscription or a producer
// republishing the order does not send it twice.
//
// Configuration, from the environment:
//
//	GOOGLE_CLOUD_PROJECT   the project whose Datastore keeps the records
//	                       (or DATASTORE_PROJECT_ID; DATASTORE_EMULATOR_HOST
//	                       points it at an emulator)
//	SUPPLIER_URL           where orders are POSTed; unset: they are only logged
//
// With no project configured the backend is the in-memory fake.Store, which
// de-duplicates within one instance only: enough to run the function
// locally (go run ./function_example/cmd/local), not for a deployment.
package function

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log"
	"log/slog"
	"net/http"
	"os"
	"strconv"

	"github.com/GoogleCloudPlatform/functions-framework-go/functions"
	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
)

func init() {
	if os.Getenv("K_SERVICE") != "" {
		// On Cloud Run, log JSON that Cloud Logging reads severities from.
		slog.SetDefault(slog.New(idempotency.NewLogHandler(os.Stderr, nil)))
	}
	guard := idempotency.Idempotent(backend(),
		idempotency.WithKey(idempotency.Attribute("po_id")),
		idempotency.WithKeyPrefix("orders:"),
	)
	functions.CloudEvent("HandleOrder", guard(HandleOrder))
}

// backend returns Datastore when a project is configured, else memory.
func backend() store.Backend {
	if os.Getenv("GOOGLE_CLOUD_PROJECT") == "" && os.Getenv("DATASTORE_PROJECT_ID") == "" {
		if os.Getenv("K_SERVICE") != "" {
			slog.Warn("no GOOGLE_CLOUD_PROJECT: using the in-memory store, which does not de-duplicate across instances")
		}
		return fake.New()
	}
	b, err := datastorelock.New(context.Background(), "")
	if err != nil {
		// Fail the instance's start-up: serving without a guard would
		// repeat side effects.
		log.Fatalf("datastore backend: %v", err)
	}
	return b
}

// Order is the payload of an order message.
type Order struct {
	Order struct {
		ID  string `json:"id"`
		Qty int    `json:"qty"`
	} `json:"order"`
}

// HandleOrder sends the order in the event to the supplier. It returns an
// error, so the message is retried, when the order cannot be sent.
func HandleOrder(ctx context.Context, e cloudevents.Event) error {
	ev, err := idempotency.ParsePubSub(e)
	if err != nil {
		return err
	}
	var o Order
	if err := json.Unmarshal(ev.Message.Data, &o); err != nil {
		// A payload that can never be parsed is poison: log it and ack,
		// rather than retrying it until the dead-letter topic takes it.
		slog.ErrorContext(ctx, "order payload is not JSON; dropping it", "message_id", ev.Message.ID, "error", err)
		return nil
	}
	claim, _ := idempotency.ClaimFrom(ctx)
	slog.InfoContext(ctx, "sending order to the supplier", "order", o.Order.ID, "qty", o.Order.Qty, "fence", claim.Fence)
	url := os.Getenv("SUPPLIER_URL")
	if url == "" {
		return nil
	}
	body, _ := json.Marshal(o)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	// Let the supplier de-duplicate too: a crash between its reply and our
	// Complete re-sends under the same key.
	req.Header.Set("Idempotency-Key", claim.Key)
	req.Header.Set("X-Fence", strconv.FormatInt(claim.Fence, 10))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("sending order %s: %w", o.Order.ID, err)
	}
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("sending order %s: supplier answered %s", o.Order.ID, resp.Status)
	}
	return nil
}
