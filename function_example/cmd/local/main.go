// Command local runs the example function on this machine, the way the
// Cloud Run functions buildpack runs it (the functions framework with
// FUNCTION_TARGET=HandleOrder), beside a stand-in supplier. It then
// delivers one order three times, as Pub/Sub might (the first delivery, a
// redelivery, and a producer republish with a new messageId), and reports
// what the supplier received.
//
//	go run ./function_example/cmd/local                    # the demo, then exit
//	go run ./function_example/cmd/local -serve             # keep serving on -port
//	REDIS_ADDR=127.0.0.1:6379 go run ./function_example/cmd/local -backend=redis
//
// It runs on the in-memory store whatever the environment says: the
// variables that choose a deployed function's store (IDEMPOTENCY_BACKEND, a
// GOOGLE_CLOUD_PROJECT exported on a workstation, ...) are not read. A real
// store only by the -backend flag, which then reads that store's setting:
// REDIS_ADDR, POSTGRES_DSN, or GOOGLE_CLOUD_PROJECT (or DATASTORE_PROJECT_ID,
// with DATASTORE_EMULATOR_HOST for an emulator). On a real store each run
// sends an order of its own, so that the records of an earlier run do not
// suppress it.
package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/GoogleCloudPlatform/functions-framework-go/functions"

	"github.com/gcp-pubsub-idempotency/idempotency/function_example/orders"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/ffserve"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

func main() {
	err := run(os.Args[1:], os.Stdout, os.Stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case errors.Is(err, errUsage):
		os.Exit(2)
	case err != nil:
		fmt.Fprintln(os.Stderr, "local:", err)
		os.Exit(1)
	}
}

// errUsage is a bad command line, already reported with the usage.
var errUsage = errors.New("usage")

// run is the command: the demo, and with -serve the function kept serving.
func run(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("local", flag.ContinueOnError)
	fs.SetOutput(stderr)
	port := fs.String("port", "", "port to serve the function on (default: a free one)")
	serve := fs.Bool("serve", false, "keep serving after the demo")
	backend := fs.String("backend", orders.Memory, "the store of the idempotency records: memory, or a real one: "+
		"redis (reads REDIS_ADDR), postgres (POSTGRES_DSN) or datastore (GOOGLE_CLOUD_PROJECT or DATASTORE_PROJECT_ID; "+
		"DATASTORE_EMULATOR_HOST for an emulator); no other variable chooses it")
	lease := fs.Duration("lease", store.DefaultLease, "the lease of a claim")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: local [-backend=memory|redis|postgres|datastore] [-serve] [-port=N] [-lease=D]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return errUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "local: unexpected argument %q\n", fs.Arg(0))
		fs.Usage()
		return errUsage
	}
	if *lease <= 0 {
		return fmt.Errorf("-lease=%v: want a positive duration", *lease)
	}
	choice, err := orders.Env{}.Named(*backend)
	if err != nil {
		return fmt.Errorf("-backend=%s: %w", *backend, err)
	}

	// Show the function's logs in line with the demo's own output.
	slog.SetDefault(slog.New(slog.NewTextHandler(stdout, &slog.HandlerOptions{
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey && len(groups) == 0 {
				return slog.Attr{}
			}
			return a
		},
	})))
	b, err := orders.Open(context.Background(), choice)
	if err != nil {
		return err
	}
	// What the function's init does, over the store chosen here.
	for name, fn := range orders.Functions(b, *lease) {
		functions.CloudEvent(name, fn)
	}

	// The stand-in supplier counts the orders it receives.
	var mu sync.Mutex
	received := map[string]int{}
	supplier := http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		received[r.Header.Get("Idempotency-Key")]++
		mu.Unlock()
	})}
	sl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go supplier.Serve(sl)
	os.Setenv("SUPPLIER_URL", "http://"+sl.Addr().String())

	os.Setenv("FUNCTION_TARGET", "HandleOrder")
	base, failed, err := ffserve.Start(*port)
	if err != nil {
		return err
	}
	url := base + "/"
	fmt.Fprintf(stdout, "HandleOrder is serving on %s (%s)\n\n", url, describe(choice))

	po := "PO-1001"
	if choice.Kind != orders.Memory {
		// A real store keeps the last run's records: a fresh order.
		po = fmt.Sprintf("PO-1001-%d", time.Now().UnixNano())
	}
	deliveries := []struct{ what, messageID string }{
		{"first delivery", "11223344556677"},
		{"redelivery of the same message", "11223344556677"},
		{"producer republish, new messageId", "99999999999999"},
	}
	for i, d := range deliveries {
		fmt.Fprintf(stdout, "delivery %d: %s (messageId %s, po_id %s)\n", i+1, d.what, d.messageID, po)
		status, err := deliver(url, po, d.messageID)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "  -> HTTP %d (%s)\n\n", status, verdict(status))
	}
	mu.Lock()
	n := received["orders:"+po]
	mu.Unlock()
	fmt.Fprintf(stdout, "the supplier received order %s %d time(s) from %d deliveries: ", po, n, len(deliveries))
	if n != 1 {
		fmt.Fprintln(stdout, "DUPLICATE SENT")
		return fmt.Errorf("order %s sent %d times, want once", po, n)
	}
	fmt.Fprintln(stdout, "the duplicates were suppressed")
	if *serve {
		fmt.Fprintf(stdout, "\nstill serving on %s; post Pub/Sub CloudEvents to it (Ctrl-C to stop)\n", url)
		return <-failed
	}
	return nil
}

// describe names the store, without its credentials.
func describe(c orders.Choice) string {
	switch c.Kind {
	case orders.Redis:
		return "Redis, REDIS_ADDR"
	case orders.Postgres:
		return "PostgreSQL, POSTGRES_DSN"
	case orders.Datastore:
		return "Datastore, project " + c.Project
	}
	return "in-memory store"
}

// deliver posts an Eventarc-shaped binary CloudEvent for one order message.
func deliver(url, po, messageID string) (int, error) {
	data, _ := json.Marshal(map[string]any{"order": map[string]any{"id": po, "qty": 3}})
	msg, _ := json.Marshal(map[string]any{
		"message": map[string]any{
			"attributes":  map[string]string{"po_id": po},
			"data":        base64.StdEncoding.EncodeToString(data),
			"messageId":   messageID,
			"publishTime": "2026-11-29T12:00:00Z",
		},
		"subscription":    "projects/my-project/subscriptions/orders-sub",
		"deliveryAttempt": 1,
	})
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(msg))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Ce-Id", messageID)
	req.Header.Set("Ce-Source", "//pubsub.googleapis.com/projects/my-project/topics/orders")
	req.Header.Set("Ce-Specversion", "1.0")
	req.Header.Set("Ce-Type", "google.cloud.pubsub.topic.v1.messagePublished")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, nil
}

func verdict(status int) string {
	switch {
	case status/100 == 2:
		return "ack"
	case status == http.StatusServiceUnavailable:
		return "nack: in progress elsewhere"
	}
	return "nack"
}
