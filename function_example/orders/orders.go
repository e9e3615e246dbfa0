// Package orders is the business side of the example: an order handler
// that must send each order to a supplier once, and a status-update handler
// whose read-modify-writes of one order must never interleave.
//
// Configuration, from the environment (see [Env.Choose] for the rules):
//
//	IDEMPOTENCY_BACKEND    where the records live: datastore, redis, postgres
//	                       or memory. Unset: the one the variables below
//	                       configure (REDIS_ADDR, else POSTGRES_DSN, else a
//	                       project for Datastore, else memory); setting both
//	                       REDIS_ADDR and POSTGRES_DSN without it is an error.
//	                       On Cloud Run (K_SERVICE set) never memory: without
//	                       a project variable, Datastore in the project the
//	                       metadata server names, or no start at all
//	REDIS_ADDR             redis: host:port of Redis or Memorystore, several
//	                       comma-separated for a Redis Cluster, or a
//	                       redis:// (rediss://) URL with credentials
//	POSTGRES_DSN           postgres: a pgx connection string (URL or
//	                       key=value) of a PostgreSQL, Cloud SQL or AlloyDB
//	                       database; the table idempotency_keys is created at
//	                       start-up if missing (delete expired rows now and
//	                       then with sqllock's PurgeExpired)
//	GOOGLE_CLOUD_PROJECT   datastore: the project whose Datastore keeps the
//	                       records (or DATASTORE_PROJECT_ID;
//	                       DATASTORE_EMULATOR_HOST points it at an emulator)
//	IDEMPOTENCY_ALLOW_MEMORY_ON_CLOUD_RUN
//	                       true lets IDEMPOTENCY_BACKEND=memory start on Cloud
//	                       Run, for a deployment that accepts duplicates
//	IDEMPOTENCY_LEASE      the lease, as a Go duration (default 15m); it must
//	                       exceed the longest run of a handler
//	SUPPLIER_URL           the supplier's base URL; unset: orders are only logged
//
// The memory backend de-duplicates within one instance only: it is for
// local development, never for a deployed fleet.
package orders

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// OrderOptions guard HandleOrder: keyed by the order id (attribute po_id),
// so a redelivery, a second subscription and a producer's republish all
// collapse into one send.
func OrderOptions(lease time.Duration) []idempotency.Option {
	return []idempotency.Option{
		idempotency.WithKey(idempotency.Attribute("po_id")),
		idempotency.WithKeyPrefix("orders:"),
		idempotency.WithLease(lease),
	}
}

// Order is the payload of an order message.
type Order struct {
	Order struct {
		ID  string `json:"id"`
		Qty int    `json:"qty"`
	} `json:"order"`
}

// HandleOrder sends the order in the event to the supplier. It returns an
// error, so the message is retried, when the supplier cannot take it.
func HandleOrder(ctx context.Context, e cloudevents.Event) error {
	ev, err := idempotency.ParsePubSub(e)
	if err != nil {
		return err
	}
	var o Order
	if err := json.Unmarshal(ev.Message.Data, &o); err != nil {
		// Poison: it will never parse. Log it and ack, rather than retry
		// it until the dead-letter topic takes it.
		slog.ErrorContext(ctx, "order payload is not JSON; dropping it", "message_id", ev.Message.ID, "error", err)
		return nil
	}
	claim, _ := idempotency.ClaimFrom(ctx)
	slog.InfoContext(ctx, "sending order to the supplier", "order", o.Order.ID, "qty", o.Order.Qty, "fence", claim.Fence)
	base := os.Getenv("SUPPLIER_URL")
	if base == "" {
		return nil
	}
	body, _ := json.Marshal(o)
	// The supplier de-duplicates on the key we hold: a crash between its
	// reply and our Complete re-sends under the same key, a no-op there.
	return call(ctx, http.MethodPost, base+"/orders", body, map[string]string{
		"Idempotency-Key": claim.Key,
		"X-Fence":         strconv.FormatInt(claim.Fence, 10),
	}, nil)
}

// Functions returns the example's two CloudEvent functions by the names
// they are registered under with the functions framework, HandleOrder and
// HandleStatusUpdate, each guarded by [idempotency.Idempotent] over b.
func Functions(b store.Backend, lease time.Duration) map[string]idempotency.CloudEventFunc {
	return map[string]idempotency.CloudEventFunc{
		"HandleOrder":        idempotency.Idempotent(b, OrderOptions(lease)...)(HandleOrder),
		"HandleStatusUpdate": idempotency.Idempotent(b, StatusOptions(lease)...)(HandleStatusUpdate(b, lease)),
	}
}

// StatusOptions guard HandleStatusUpdate by messageId: the same update
// delivered twice is applied once.
func StatusOptions(lease time.Duration) []idempotency.Option {
	return []idempotency.Option{idempotency.WithLease(lease)}
}

// HandleStatusUpdate returns the handler for status updates (attributes
// po_id and status). Every update of an order is applied, in turn: a
// Mutex on the order keeps two read-modify-writes of its status history
// from interleaving; a busy order makes the delivery come back later.
func HandleStatusUpdate(b store.Backend, lease time.Duration) idempotency.CloudEventFunc {
	return func(ctx context.Context, e cloudevents.Event) error {
		ev, err := idempotency.ParsePubSub(e)
		if err != nil {
			return err
		}
		po, status := ev.Message.Attributes["po_id"], ev.Message.Attributes["status"]
		if po == "" || status == "" {
			slog.ErrorContext(ctx, "status update without po_id or status; dropping it", "message_id", ev.Message.ID)
			return nil
		}
		return idempotency.Mutex(ctx, b, "po:"+po, func(ctx context.Context) error {
			base := os.Getenv("SUPPLIER_URL")
			if base == "" {
				slog.InfoContext(ctx, "status update", "order", po, "status", status)
				return nil
			}
			u := base + "/status/" + url.PathEscape(po)
			var history []string
			if err := call(ctx, http.MethodGet, u, nil, nil, &history); err != nil {
				return err
			}
			body, _ := json.Marshal(append(history, status))
			return call(ctx, http.MethodPut, u, body, nil, nil)
		}, idempotency.WithLease(lease))
	}
}

// call sends one request to the supplier and decodes a JSON reply into out.
func call(ctx context.Context, method, u string, body []byte, headers map[string]string, out any) error {
	req, err := http.NewRequestWithContext(ctx, method, u, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("supplier %s %s: %w", method, u, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("supplier %s %s: %s %s", method, u, resp.Status, bytes.TrimSpace(b))
	}
	if out != nil {
		return json.NewDecoder(resp.Body).Decode(out)
	}
	return nil
}
