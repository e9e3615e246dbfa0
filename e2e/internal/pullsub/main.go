// Command pullsub is the pull crash storm's subscriber process: it
// Receives from one subscription of the Pub/Sub emulator with the pull
// adapter, keyed by the order's po_id attribute as the example's
// HandleOrder is, on the backend the example's variables choose.
//
// Environment, beside the example's (IDEMPOTENCY_BACKEND, REDIS_ADDR,
// POSTGRES_DSN, DATASTORE_PROJECT_ID, IDEMPOTENCY_LEASE, SUPPLIER_URL):
//
//	PUBSUB_EMULATOR_HOST   the emulator
//	PUBSUB_PROJECT         the project of the subscription
//	PUBSUB_SUBSCRIPTION    the subscription's id
//	PORT                   where it answers the harness's readiness probe
//	E2E_INCARNATION        the harness's number for this process
//	E2E_MAX_EXTENSION      ReceiveSettings.MaxExtension (a Go duration)
//	E2E_ACK_EXTENSION      ReceiveSettings.MaxDurationPerAckExtension
//	E2E_MAX_OUTSTANDING    ReceiveSettings.MaxOutstandingMessages
//	E2E_CRASH_RATE         the chance of exiting (status 3) right after the
//	                       effect, before the key is completed
//	E2E_MODE               "send" (default): POST the order to the
//	                       supplier; "tx": INSERT it into e2e_pull_sink in
//	                       E2E_SINK_TABLE in the handler's transaction
//	                       (postgres only; the harness creates the table)
//	E2E_BROKEN             complete-noop or claim-always-wins: wrap the
//	                       backend in that defect (send mode only)
//
// It writes one line per event the harness reads: "e2e: delivery" when a
// message reaches the callback, "e2e: handled" when the callback returns
// (it has acked or nacked), "e2e: completed" when the backend reported a
// key done (the library acks after that), each with at=<unix µs>.
package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"time"

	"cloud.google.com/go/pubsub/v2"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/e2e/internal/broken"
	"github.com/gcp-pubsub-idempotency/idempotency/function_example/orders"
	"github.com/gcp-pubsub-idempotency/idempotency/pull"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

func main() {
	if err := run(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "pullsub:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	rate, err := strconv.ParseFloat(os.Getenv("E2E_CRASH_RATE"), 64)
	if err != nil {
		return fmt.Errorf("E2E_CRASH_RATE: %w", err)
	}
	maxExt, err := time.ParseDuration(os.Getenv("E2E_MAX_EXTENSION"))
	if err != nil {
		return fmt.Errorf("E2E_MAX_EXTENSION: %w", err)
	}
	perAck, err := time.ParseDuration(os.Getenv("E2E_ACK_EXTENSION"))
	if err != nil {
		return fmt.Errorf("E2E_ACK_EXTENSION: %w", err)
	}
	outstanding, err := strconv.Atoi(os.Getenv("E2E_MAX_OUTSTANDING"))
	if err != nil {
		return fmt.Errorf("E2E_MAX_OUTSTANDING: %w", err)
	}
	lease, err := orders.Lease()
	if err != nil {
		return err
	}
	client, err := pubsub.NewClient(ctx, os.Getenv("PUBSUB_PROJECT"))
	if err != nil {
		return err
	}
	sub := client.Subscriber(os.Getenv("PUBSUB_SUBSCRIPTION"))
	sub.ReceiveSettings.MaxExtension = maxExt
	sub.ReceiveSettings.MaxOutstandingMessages = outstanding
	// The stream's ack deadline: without it the client asks for 60 s, and
	// a message handed to a process that then dies comes back only after
	// that, whatever the subscription's deadline.
	sub.ReceiveSettings.MaxDurationPerAckExtension = perAck
	w := worker{rate: rate, incarnation: os.Getenv("E2E_INCARNATION"), supplier: os.Getenv("SUPPLIER_URL"), sink: os.Getenv("E2E_SINK_TABLE")}
	opts := orders.OrderOptions(lease)

	var handle func(context.Context, *pubsub.Message)
	switch mode := os.Getenv("E2E_MODE"); mode {
	case "", "send":
		b, err := orders.Backend(ctx)
		if err != nil {
			return err
		}
		if b, err = broken.Wrap(b, os.Getenv("E2E_BROKEN")); err != nil {
			return err
		}
		handle = pull.Handler(sub, record(b), w.send, opts...)
	case "tx":
		if w.sink == "" {
			return errors.New("E2E_MODE=tx needs E2E_SINK_TABLE")
		}
		db, err := sql.Open("pgx", os.Getenv("POSTGRES_DSN"))
		if err != nil {
			return err
		}
		db.SetMaxOpenConns(10)
		b, err := sqllock.New(db, sqllock.Postgres)
		if err != nil {
			return err
		}
		if err := b.EnsureSchema(ctx); err != nil {
			return err
		}
		handle = pull.HandlerTx(sub, txRecorder{b}, w.insert, opts...)
	default:
		return fmt.Errorf("E2E_MODE=%q: want send or tx", mode)
	}

	go func() {
		// The readiness probe: the harness waits for it before it counts
		// the process as started.
		err := http.ListenAndServe("127.0.0.1:"+os.Getenv("PORT"), http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
		log.Fatal(err)
	}()
	return sub.Receive(ctx, func(ctx context.Context, m *pubsub.Message) {
		event("delivery", "id", m.ID, "key", m.Attributes["po_id"])
		handle(ctx, m)
		event("handled", "id", m.ID)
	})
}

// event writes one line for the harness.
func event(what string, kv ...string) {
	var b bytes.Buffer
	fmt.Fprintf(&b, "e2e: %s", what)
	for i := 0; i+1 < len(kv); i += 2 {
		fmt.Fprintf(&b, " %s=%s", kv[i], kv[i+1])
	}
	fmt.Fprintf(&b, " at=%d\n", time.Now().UnixMicro())
	os.Stderr.Write(b.Bytes())
}

// worker is the effect of one order.
type worker struct {
	rate        float64
	incarnation string
	supplier    string
	sink        string
}

// crash exits at the worker's rate: after the effect, before the key is
// completed (the crash window no lock closes, and in tx mode before the
// commit).
func (w worker) crash() {
	if rand.Float64() < w.rate {
		fmt.Fprintln(os.Stderr, "e2e: crashing after the effect, before complete")
		os.Exit(3)
	}
}

// work stands for the handler's own work before its effect, so that the
// harness's kills land mid-handler too.
func work() { time.Sleep(time.Duration(rand.IntN(200)) * time.Millisecond) }

// send POSTs the order to the supplier as HandleOrder does, under the
// claim's key and fence, with the process's number and the lease expiry.
func (w worker) send(ctx context.Context, m *pubsub.Message) error {
	claim, ok := idempotency.ClaimFrom(ctx)
	if !ok {
		return errors.New("no claim in the handler's context")
	}
	var o orders.Order
	if err := json.Unmarshal(m.Data, &o); err != nil {
		return fmt.Errorf("order payload: %w", err)
	}
	work()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.supplier+"/orders", bytes.NewReader(m.Data))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", claim.Key)
	req.Header.Set("X-Fence", strconv.FormatInt(claim.Fence, 10))
	req.Header.Set("X-E2E-Incarnation", w.incarnation)
	req.Header.Set("X-E2E-Lease-Expiry", strconv.FormatInt(claim.LeaseExpiry.UnixMilli(), 10))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("supplier: %s", resp.Status)
	}
	w.crash()
	return nil
}

// insert writes the order into the sink table in the handler's
// transaction.
func (w worker) insert(ctx context.Context, m *pubsub.Message, tx *sql.Tx) error {
	claim, ok := idempotency.ClaimFrom(ctx)
	if !ok {
		return errors.New("no claim in the handler's context")
	}
	work()
	if _, err := tx.ExecContext(ctx, "INSERT INTO "+w.sink+" (key, fence, incarnation, message_id) VALUES ($1, $2, $3, $4)",
		claim.Key, claim.Fence, w.incarnation, m.ID); err != nil {
		return err
	}
	w.crash()
	return nil
}

// record wraps b so that it writes "e2e: completed" when it reports a key
// done, keeping the fingerprints of a backend that stores them.
func record(b store.Backend) store.Backend {
	if f, ok := b.(store.Fingerprinter); ok {
		return fpRecorder{recorder{b}, f}
	}
	return recorder{b}
}

type recorder struct{ store.Backend }

// Claim writes "e2e: found-done" when the key was done already: a process
// SIGKILLed between its Complete and the "completed" line leaves a done
// key that no line reports, until its redelivery finds it done.
func (r recorder) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	return foundDone(key)(r.Backend.Claim(ctx, key, lease))
}

// foundDone returns a function that passes a claim's answer on, writing
// "e2e: found-done" when it says the key is done.
func foundDone(key string) func(store.Result, error) (store.Result, error) {
	return func(res store.Result, err error) (store.Result, error) {
		if err == nil && res.Outcome == store.AlreadyDone {
			event("found-done", "key", key)
		}
		return res, err
	}
}

func (r recorder) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return completed(c)(r.Backend.Complete(ctx, c))
}

type fpRecorder struct {
	recorder
	f store.Fingerprinter
}

func (r fpRecorder) CompleteFingerprint(ctx context.Context, c store.Claim, fp string) (bool, error) {
	return completed(c)(r.f.CompleteFingerprint(ctx, c, fp))
}

// completed returns a function that passes a completion's answer on,
// writing "e2e: completed" when it says c's key is done.
func completed(c store.Claim) func(bool, error) (bool, error) {
	return func(ok bool, err error) (bool, error) {
		if ok && err == nil {
			event("completed", "key", c.Key)
		}
		return ok, err
	}
}

// txRecorder writes "e2e: completed" when a transaction that marked a key
// done committed.
type txRecorder struct{ *sqllock.Backend }

func (r txRecorder) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	return foundDone(key)(r.Backend.Claim(ctx, key, lease))
}

func (r txRecorder) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(context.Context, *sql.Tx) error) (bool, error) {
	return completed(c)(r.Backend.CompleteTx(ctx, c, fp, body))
}
