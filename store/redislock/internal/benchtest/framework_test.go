package benchtest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/GoogleCloudPlatform/functions-framework-go/funcframework"
	cloudevents "github.com/cloudevents/sdk-go/v2"
	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/ffserve"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// The functions framework serves one function per path for the whole
// process: framework starts it once, and handler is what it runs.
var (
	frameworkOnce sync.Once
	frameworkURL  string
	frameworkErr  error
	handlerMu     sync.RWMutex
	handler       func(context.Context, cloudevents.Event) error
)

func framework(b *testing.B, h func(context.Context, cloudevents.Event) error) string {
	b.Helper()
	frameworkOnce.Do(func() {
		frameworkErr = funcframework.RegisterCloudEventFunctionContext(context.Background(), "/", func(ctx context.Context, e cloudevents.Event) error {
			handlerMu.RLock()
			h := handler
			handlerMu.RUnlock()
			return h(ctx, e)
		})
		if frameworkErr == nil {
			frameworkURL, _, frameworkErr = ffserve.Start("")
		}
	})
	if frameworkErr != nil {
		b.Fatal(frameworkErr)
	}
	handlerMu.Lock()
	handler = h
	handlerMu.Unlock()
	return frameworkURL
}

// push is an Eventarc binary-mode delivery of Pub/Sub message id, as Cloud
// Run functions receive one.
func push(url, id string) *http.Request {
	body := `{"message":{"attributes":{"po_id":"PO-` + id + `"},"data":"eyJvcmRlciI6eyJpZCI6IlBPLTEwMDEifX0=","messageId":"` + id +
		`","publishTime":"2026-11-29T12:00:00Z"},"subscription":"projects/p/subscriptions/s","deliveryAttempt":1}`
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader([]byte(body)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Ce-Id", id)
	req.Header.Set("Ce-Source", "//pubsub.googleapis.com/projects/p/topics/t")
	req.Header.Set("Ce-Specversion", "1.0")
	req.Header.Set("Ce-Type", idempotency.PubSubEventType)
	return req
}

// BenchmarkFramework delivers fresh Pub/Sub messages through the functions
// framework over loopback TCP, as Cloud Run functions runs a CloudEvent
// function, to a handler on redis-server on loopback, at 1 and 16
// concurrent workers:
//
//   - impl=plain-2-writes: the handler makes two plain writes itself (SET
//     NX PX on the message id, then SET XX PX);
//   - impl=wrapped: the handler does no writes, wrapped by
//     idempotency.Idempotent on redislock (defaults: message id key,
//     payload fingerprint).
//
// Both handlers decode the message with idempotency.ParsePubSub, as work
// on it would.
//
// Besides deliveries/s, it reports cpu-ns/op (this process: the HTTP
// client, the framework, the handler and go-redis) and
// server-cpu-us/delivery (redis-server's), which move less with the
// machine's load. Compare them with benchstat -col /impl.
func BenchmarkFramework(b *testing.B) {
	addr := testsvc.Redis(b)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, workers := range []int{1, 16} {
		for _, impl := range []string{"plain-2-writes", "wrapped"} {
			b.Run(fmt.Sprintf("impl=%s/workers=%d", impl, workers), func(b *testing.B) {
				c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: max(32, workers)})
				defer c.Close()
				prefix := fmt.Sprintf("ff:%d:", time.Now().UnixNano())
				var h func(context.Context, cloudevents.Event) error
				if impl == "wrapped" {
					be, err := redislock.New(c, redislock.WithPrefix(prefix))
					if err != nil {
						b.Fatal(err)
					}
					h = idempotency.Idempotent(be, idempotency.WithLogger(quiet))(func(_ context.Context, e cloudevents.Event) error {
						_, err := idempotency.ParsePubSub(e) // the work reads the message
						return err
					})
				} else {
					h = func(ctx context.Context, e cloudevents.Event) error {
						m, err := idempotency.ParsePubSub(e)
						if err != nil {
							return err
						}
						key := prefix + m.Message.ID
						if err := c.SetNX(ctx, key, "c", time.Minute).Err(); err != nil {
							return err
						}
						return c.SetXX(ctx, key, "d", time.Hour).Err()
					}
				}
				url := framework(b, h) + "/"
				tr := &http.Transport{MaxIdleConnsPerHost: max(2, workers)}
				defer tr.CloseIdleConnections()
				// A delivery that takes a minute is a failure, not a wait.
				client := &http.Client{Transport: tr, Timeout: time.Minute}
				run := func(id string) error {
					resp, err := client.Do(push(url, id))
					if err != nil {
						return err
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusOK {
						return fmt.Errorf("status %d", resp.StatusCode)
					}
					return nil
				}
				bench.Warm(b, workers, 8, run)
				_, cpu0 := serverStats(b, c)
				report := bench.CPU(b)
				b.ReportAllocs()
				b.ResetTimer()
				bench.Deliveries(b, workers, run)
				b.StopTimer()
				report()
				_, cpu1 := serverStats(b, c)
				b.ReportMetric((cpu1-cpu0)/float64(b.N), "server-cpu-us/delivery")
			})
		}
	}
}
