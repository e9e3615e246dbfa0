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
//	SUPPLIER_URL   where orders are POSTed; unset: they are only logged
//
// The backend is the in-memory fake.Store, which de-duplicates within one
// instance: enough to run the function locally (go run ./function_example/cmd/local).
// A deployment with more than one instance needs a shared backend.
package function

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strconv"

	"github.com/GoogleCloudPlatform/functions-framework-go/functions"
	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
)

func init() {
	if os.Getenv("K_SERVICE") != "" {
		// On Cloud Run, log JSON that Cloud Logging reads severities from.
		slog.SetDefault(slog.New(idempotency.NewLogHandler(os.Stderr, nil)))
	}
	guard := idempotency.Idempotent(fake.New(),
		idempotency.WithKey(idempotency.Attribute("po_id")),
		idempotency.WithKeyPrefix("orders:"),
	)
	functions.CloudEvent("HandleOrder", guard(HandleOrder))
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
