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
//	E2E_CRASH_DIR          where the processes mark the keys that crashed:
//	                       each key crashes at most once, and none does
//	                       once the file "stop" exists there
//	E2E_MODE               "send" (default): pull.Handler, which POSTs the
//	                       order to the supplier; "tx": pull.HandlerTx,
//	                       which INSERTs it into the table E2E_SINK_TABLE
//	                       in the handler's transaction (PostgreSQL at
//	                       POSTGRES_DSN only; the harness creates the table)
//	E2E_DRIVER             "database/sql" (default): send mode runs on the
//	                       example's backend (orders.Backend), tx mode on
//	                       sqllock with *sql.Tx; "pgx": both run on
//	                       store/pgxlock over a *pgxpool.Pool opened from
//	                       POSTGRES_DSN, tx mode with pgx.Tx (then
//	                       IDEMPOTENCY_BACKEND must be unset or postgres)
//	E2E_BROKEN             in send mode, complete-noop or claim-always-wins:
//	                       wrap the backend in that defect; in tx mode,
//	                       write-outside-tx: INSERT on the pool or DB, not
//	                       on the handler's transaction
//
// It writes one line per event the harness reads: "e2e: backend" once,
// with type=<the backend's Go type>, then "e2e: delivery" when a
// message reaches the callback, "e2e: handled" when the callback returns
// (it has acked or nacked), "e2e: completed" when the backend reported a
// key done (the library acks after that), "e2e: found-done" when a claim
// found the key done already, each with at=<unix µs>.
package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"cloud.google.com/go/pubsub/v2"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/e2e/internal/broken"
	"github.com/gcp-pubsub-idempotency/idempotency/function_example/orders"
	"github.com/gcp-pubsub-idempotency/idempotency/pull"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/pgxlock"
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
	w := worker{rate: rate, crashDir: os.Getenv("E2E_CRASH_DIR"), incarnation: os.Getenv("E2E_INCARNATION"), supplier: os.Getenv("SUPPLIER_URL"), sink: os.Getenv("E2E_SINK_TABLE")}

	handle, err := handler(ctx, sub, w, orders.OrderOptions(lease))
	if err != nil {
		return err
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

// handler returns the callback E2E_MODE, E2E_DRIVER and E2E_BROKEN
// choose, and writes the "e2e: backend" line.
func handler(ctx context.Context, sub *pubsub.Subscriber, w worker, opts []idempotency.Option) (func(context.Context, *pubsub.Message), error) {
	driver, mode, defect := os.Getenv("E2E_DRIVER"), os.Getenv("E2E_MODE"), os.Getenv("E2E_BROKEN")
	switch driver {
	case "", "database/sql":
	case "pgx":
		if kind := os.Getenv("IDEMPOTENCY_BACKEND"); kind != "" && kind != orders.Postgres {
			return nil, fmt.Errorf("E2E_DRIVER=pgx runs on PostgreSQL (POSTGRES_DSN), but IDEMPOTENCY_BACKEND=%q", kind)
		}
	default:
		return nil, fmt.Errorf("E2E_DRIVER=%q: want database/sql or pgx", driver)
	}
	switch mode {
	case "", "send":
		var b store.Backend
		var err error
		if driver == "pgx" {
			_, b, err = openPgxlock(ctx)
		} else {
			b, err = orders.Backend(ctx)
		}
		if err != nil {
			return nil, err
		}
		event("backend", "type", fmt.Sprintf("%T", b))
		if b, err = broken.Wrap(b, defect); err != nil {
			return nil, err
		}
		return pull.Handler(sub, record(b), w.send, opts...), nil
	case "tx":
		if w.sink == "" {
			return nil, errors.New("E2E_MODE=tx needs E2E_SINK_TABLE")
		}
		if defect != "" && defect != writeOutsideTx {
			return nil, fmt.Errorf("E2E_BROKEN=%q: E2E_MODE=tx knows only %s", defect, writeOutsideTx)
		}
		outside := defect == writeOutsideTx
		if driver == "pgx" {
			pool, b, err := openPgxlock(ctx)
			if err != nil {
				return nil, err
			}
			return txHandler(sub, w, b, outside, func(ctx context.Context, tx pgx.Tx, q string, args ...any) error {
				_, err := tx.Exec(ctx, q, args...)
				return err
			}, func(ctx context.Context, q string, args ...any) error {
				_, err := pool.Exec(ctx, q, args...)
				return err
			}, opts), nil
		}
		db, err := sql.Open("pgx", os.Getenv("POSTGRES_DSN"))
		if err != nil {
			return nil, err
		}
		db.SetMaxOpenConns(maxConns)
		b, err := sqllock.New(db, sqllock.Postgres)
		if err != nil {
			return nil, err
		}
		if err := b.EnsureSchema(ctx); err != nil {
			return nil, err
		}
		return txHandler(sub, w, b, outside, func(ctx context.Context, tx *sql.Tx, q string, args ...any) error {
			_, err := tx.ExecContext(ctx, q, args...)
			return err
		}, func(ctx context.Context, q string, args ...any) error {
			_, err := db.ExecContext(ctx, q, args...)
			return err
		}, opts), nil
	}
	return nil, fmt.Errorf("E2E_MODE=%q: want send or tx", mode)
}

// writeOutsideTx is tx mode's E2E_BROKEN defect: the sink's INSERT runs
// on the pool (or DB), committed at once, not on the handler's
// transaction, so a process that dies before the commit leaves its row,
// and the redelivery writes another.
const writeOutsideTx = "write-outside-tx"

// maxConns bounds each process's connections to PostgreSQL.
const maxConns = 10

// openPgxlock opens a pool on POSTGRES_DSN and a pgxlock backend on it,
// with its table made.
func openPgxlock(ctx context.Context) (*pgxpool.Pool, *pgxlock.Backend, error) {
	cfg, err := pgxpool.ParseConfig(os.Getenv("POSTGRES_DSN"))
	if err != nil {
		return nil, nil, fmt.Errorf("POSTGRES_DSN: %w", err)
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, err
	}
	b, err := pgxlock.New(pool)
	if err != nil {
		return nil, nil, err
	}
	if err := b.EnsureSchema(ctx); err != nil {
		return nil, nil, fmt.Errorf("pgxlock: creating the table: %w", err)
	}
	return pool, b, nil
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
	crashDir    string
	incarnation string
	supplier    string
	sink        string
}

// crash exits at the worker's rate: after the effect, before the key is
// completed (the crash window no lock closes, and in tx mode before the
// commit). Each key crashes at most once, and none after the harness
// said stop: a crash strands the message for an ack deadline, and the
// emulator doubles that wait each time the same message is stranded
// again, so crashes without a bound could keep one key from its end for
// longer than the harness waits.
func (w worker) crash(key string) {
	if rand.Float64() >= w.rate {
		return
	}
	if w.crashDir != "" {
		if _, err := os.Stat(filepath.Join(w.crashDir, "stop")); err == nil {
			return
		}
		f, err := os.OpenFile(filepath.Join(w.crashDir, hex.EncodeToString([]byte(key))), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
		if err != nil {
			return // crashed before, or the mark cannot be made: no crash
		}
		f.Close()
	}
	fmt.Fprintln(os.Stderr, "e2e: crashing after the effect, before complete")
	os.Exit(3)
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
	w.crash(claim.Key)
	return nil
}

// txHandler writes the "e2e: backend" line and returns pull.HandlerTx on
// b with the handler that INSERTs the order into the sink table: by
// onTx, on the handler's transaction, or, when outside (the
// write-outside-tx defect), by onPool, committed at once.
func txHandler[Tx any](sub *pubsub.Subscriber, w worker, b store.TxBackend[Tx], outside bool,
	onTx func(ctx context.Context, tx Tx, q string, args ...any) error, onPool func(ctx context.Context, q string, args ...any) error,
	opts []idempotency.Option) func(context.Context, *pubsub.Message) {
	event("backend", "type", fmt.Sprintf("%T", b))
	return pull.HandlerTx(sub, txRecorder[Tx]{b}, func(ctx context.Context, m *pubsub.Message, tx Tx) error {
		claim, ok := idempotency.ClaimFrom(ctx)
		if !ok {
			return errors.New("no claim in the handler's context")
		}
		work()
		q, args := "INSERT INTO "+w.sink+" (key, fence, incarnation, message_id) VALUES ($1, $2, $3, $4)",
			[]any{claim.Key, claim.Fence, w.incarnation, m.ID}
		var err error
		if outside {
			err = onPool(ctx, q, args...)
		} else {
			err = onTx(ctx, tx, q, args...)
		}
		if err != nil {
			return err
		}
		w.crash(claim.Key)
		return nil
	}, opts...)
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
// done committed, and "e2e: found-done" as recorder does.
type txRecorder[Tx any] struct{ store.TxBackend[Tx] }

func (r txRecorder[Tx]) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	return foundDone(key)(r.TxBackend.Claim(ctx, key, lease))
}

func (r txRecorder[Tx]) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(context.Context, Tx) error) (bool, error) {
	return completed(c)(r.TxBackend.CompleteTx(ctx, c, fp, body))
}
