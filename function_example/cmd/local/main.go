// Command local runs the example function on this machine, the way the
// Cloud Run functions buildpack runs it (funcframework with
// FUNCTION_TARGET=HandleOrder), on the in-memory store, beside a stand-in
// supplier. It then delivers one order three times, as Pub/Sub might (the
// first delivery, a redelivery, and a producer republish with a new
// messageId), and reports what the supplier received.
//
//	go run ./function_example/cmd/local           # the demo, then exit
//	go run ./function_example/cmd/local -serve    # keep serving on -port
package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"

	_ "github.com/gcp-pubsub-idempotency/idempotency/function_example"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/ffserve"
)

func main() {
	port := flag.String("port", "", "port to serve the function on (default: a free one)")
	serve := flag.Bool("serve", false, "keep serving after the demo")
	flag.Parse()
	log.SetFlags(0)
	// Show the function's logs in line with the demo's own output.
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey && len(groups) == 0 {
				return slog.Attr{}
			}
			return a
		},
	})))

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
		log.Fatal(err)
	}
	go supplier.Serve(sl)
	os.Setenv("SUPPLIER_URL", "http://"+sl.Addr().String())

	os.Setenv("FUNCTION_TARGET", "HandleOrder")
	base, failed, err := ffserve.Start(*port)
	if err != nil {
		log.Fatal(err)
	}
	go func() { log.Fatal(<-failed) }()
	url := base + "/"
	fmt.Printf("HandleOrder is serving on %s (in-memory store)\n\n", url)

	deliveries := []struct{ what, messageID string }{
		{"first delivery", "11223344556677"},
		{"redelivery of the same message", "11223344556677"},
		{"producer republish, new messageId", "99999999999999"},
	}
	for i, d := range deliveries {
		fmt.Printf("delivery %d: %s (messageId %s, po_id PO-1001)\n", i+1, d.what, d.messageID)
		status := deliver(url, d.messageID)
		fmt.Printf("  -> HTTP %d (%s)\n\n", status, verdict(status))
	}
	mu.Lock()
	n := received["orders:PO-1001"]
	mu.Unlock()
	fmt.Printf("the supplier received order PO-1001 %d time(s) from %d deliveries: ", n, len(deliveries))
	if n != 1 {
		fmt.Println("DUPLICATE SENT")
		os.Exit(1)
	}
	fmt.Println("the duplicates were suppressed")
	if *serve {
		fmt.Printf("\nstill serving on %s; post Pub/Sub CloudEvents to it (Ctrl-C to stop)\n", url)
		select {}
	}
}

// deliver posts an Eventarc-shaped binary CloudEvent for one order message.
func deliver(url, messageID string) int {
	body := `{"message":{"attributes":{"po_id":"PO-1001"},"data":"eyJvcmRlciI6eyJpZCI6IlBPLTEwMDEiLCJxdHkiOjN9fQ==",` +
		`"messageId":"` + messageID + `","publishTime":"2026-11-29T12:00:00Z"},` +
		`"subscription":"projects/my-project/subscriptions/orders-sub","deliveryAttempt":1}`
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader([]byte(body)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Ce-Id", messageID)
	req.Header.Set("Ce-Source", "//pubsub.googleapis.com/projects/my-project/topics/orders")
	req.Header.Set("Ce-Specversion", "1.0")
	req.Header.Set("Ce-Type", "google.cloud.pubsub.topic.v1.messagePublished")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		log.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
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
