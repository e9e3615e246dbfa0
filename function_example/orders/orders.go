// Package orders is the business side of the example: an order handler
// that must send each order to a supplier once, and a status-update handler
// whose read-modify-writes of one order must never interleave.
//
// Configuration, from the environment:
//
//	IDEMPOTENCY_BACKEND    where the records live: datastore, redis, postgres
//	                       or memory. Unset: the one the variables below
//	                       configure (REDIS_ADDR, else POSTGRES_DSN, else a
//	                       project for Datastore, else memory); setting both
//	                       REDIS_ADDR and POSTGRES_DSN without it is an error.
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
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// Setup reads the configuration and builds the backend: what both the
// function and the Cloud Run service do at start-up.
func Setup(ctx context.Context) (store.Backend, time.Duration, error) {
	lease, err := Lease()
	if err != nil {
		return nil, 0, err
	}
	b, err := Backend(ctx)
	if err != nil {
		return nil, 0, fmt.Errorf("idempotency backend: %w", err)
	}
	return b, lease, nil
}

// Backend builds the backend the environment chooses (see the package
// documentation): Datastore, Redis, PostgreSQL or the in-memory store.
func Backend(ctx context.Context) (store.Backend, error) {
	kind, err := BackendKind()
	if err != nil {
		return nil, err
	}
	switch kind {
	case "redis":
		return redisBackend(ctx, os.Getenv("REDIS_ADDR"))
	case "postgres":
		return postgresBackend(ctx, os.Getenv("POSTGRES_DSN"))
	case "datastore":
		return datastorelock.Dial(ctx, "")
	}
	if os.Getenv("K_SERVICE") != "" {
		slog.Warn("no backend configured: using the in-memory store, which does not de-duplicate across instances")
	}
	return fake.New(), nil
}

// BackendKind returns the backend the environment chooses: "datastore",
// "redis", "postgres" or "memory". It fails on an unknown
// IDEMPOTENCY_BACKEND, on one whose settings are missing, and on an
// ambiguous environment (REDIS_ADDR and POSTGRES_DSN both set without
// IDEMPOTENCY_BACKEND).
func BackendKind() (string, error) {
	redisAddr, dsn := os.Getenv("REDIS_ADDR"), os.Getenv("POSTGRES_DSN")
	project := os.Getenv("GOOGLE_CLOUD_PROJECT") != "" || os.Getenv("DATASTORE_PROJECT_ID") != ""
	switch kind := os.Getenv("IDEMPOTENCY_BACKEND"); kind {
	case "":
		switch {
		case redisAddr != "" && dsn != "":
			return "", errors.New("both REDIS_ADDR and POSTGRES_DSN are set: choose one with IDEMPOTENCY_BACKEND=redis or postgres")
		case redisAddr != "":
			return "redis", nil
		case dsn != "":
			return "postgres", nil
		case project:
			return "datastore", nil
		}
		return "memory", nil
	case "redis":
		if redisAddr == "" {
			return "", errors.New("IDEMPOTENCY_BACKEND=redis needs REDIS_ADDR")
		}
		return kind, nil
	case "postgres":
		if dsn == "" {
			return "", errors.New("IDEMPOTENCY_BACKEND=postgres needs POSTGRES_DSN")
		}
		return kind, nil
	case "datastore":
		if !project {
			return "", errors.New("IDEMPOTENCY_BACKEND=datastore needs GOOGLE_CLOUD_PROJECT or DATASTORE_PROJECT_ID")
		}
		return kind, nil
	case "memory":
		return kind, nil
	default:
		return "", fmt.Errorf("IDEMPOTENCY_BACKEND=%q: want datastore, redis, postgres or memory", kind)
	}
}

// startupTimeout bounds the I/O a backend does at start-up.
const startupTimeout = 30 * time.Second

// redisBackend connects to REDIS_ADDR and checks that Redis answers.
func redisBackend(ctx context.Context, addr string) (store.Backend, error) {
	var client redis.UniversalClient
	if strings.HasPrefix(addr, "redis://") || strings.HasPrefix(addr, "rediss://") {
		opt, err := redis.ParseURL(addr)
		if err != nil {
			return nil, fmt.Errorf("REDIS_ADDR: %w", err)
		}
		client = redis.NewClient(opt)
	} else {
		// One address: a single node; several: a Cluster.
		client = redis.NewUniversalClient(&redis.UniversalOptions{Addrs: strings.Split(addr, ",")})
	}
	ctx, cancel := context.WithTimeout(ctx, startupTimeout)
	defer cancel()
	if err := client.Ping(ctx).Err(); err != nil {
		client.Close()
		return nil, fmt.Errorf("redis at %s: %w", addr, err)
	}
	return redislock.New(client)
}

// postgresMaxConns caps each instance's connections, so a fleet of
// instances stays within the server's max_connections.
const postgresMaxConns = 10

// postgresBackend opens POSTGRES_DSN and creates the table if missing.
func postgresBackend(ctx context.Context, dsn string) (store.Backend, error) {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return nil, fmt.Errorf("POSTGRES_DSN: %w", err)
	}
	db.SetMaxOpenConns(postgresMaxConns)
	db.SetMaxIdleConns(postgresMaxConns)
	b, err := sqllock.New(db, sqllock.Postgres)
	if err != nil {
		db.Close()
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, startupTimeout)
	defer cancel()
	if err := b.EnsureSchema(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("postgres: creating the table: %w", err)
	}
	return b, nil
}

// Lease returns IDEMPOTENCY_LEASE, or store.DefaultLease.
func Lease() (time.Duration, error) {
	v := os.Getenv("IDEMPOTENCY_LEASE")
	if v == "" {
		return store.DefaultLease, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("IDEMPOTENCY_LEASE=%q is not a positive duration", v)
	}
	return d, nil
}

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
