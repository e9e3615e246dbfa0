package idempotency_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// deliveryRequest builds an Eventarc binary-mode delivery of message id.
func deliveryRequest(url, id string) *http.Request {
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

// receiver is the CloudEvents HTTP handler the functions framework builds
// around a CloudEvent function, without the TCP hop.
func receiver(b testing.TB, fn idempotency.CloudEventFunc) http.Handler {
	p, err := cloudevents.NewHTTP()
	if err != nil {
		b.Fatal(err)
	}
	h, err := cloudevents.NewHTTPReceiveHandler(context.Background(), p, fn)
	if err != nil {
		b.Fatal(err)
	}
	return h
}

func noop(context.Context, cloudevents.Event) error { return nil }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// BenchmarkDelivery compares one delivery through the CloudEvents HTTP
// handler, unwrapped and wrapped by Idempotent on fake.Store: fresh message
// ids (claim + complete each) and redeliveries of one id (a duplicate),
// with the default payload fingerprint and without (WithFingerprint(nil)).
func BenchmarkDelivery(b *testing.B) {
	cases := []struct {
		name  string
		fn    func() idempotency.CloudEventFunc
		fresh bool
	}{
		{"unwrapped", func() idempotency.CloudEventFunc { return noop }, true},
		{"wrapped", func() idempotency.CloudEventFunc {
			return idempotency.Idempotent(fake.New(), idempotency.WithLogger(quiet))(noop)
		}, true},
		{"wrapped_duplicate", func() idempotency.CloudEventFunc {
			return idempotency.Idempotent(fake.New(), idempotency.WithLogger(quiet))(noop)
		}, false},
		// The default payload fingerprint's cost: the same deliveries
		// without it, beside "wrapped" and "wrapped_duplicate".
		{"wrapped_no_fingerprint", func() idempotency.CloudEventFunc {
			return idempotency.Idempotent(fake.New(), idempotency.WithLogger(quiet), idempotency.WithFingerprint(nil))(noop)
		}, true},
		{"wrapped_duplicate_no_fingerprint", func() idempotency.CloudEventFunc {
			return idempotency.Idempotent(fake.New(), idempotency.WithLogger(quiet), idempotency.WithFingerprint(nil))(noop)
		}, false},
	}
	// loop delivers b.N messages through do, which returns the status.
	loop := func(b *testing.B, fresh bool, do func(id string) int) {
		b.ReportAllocs()
		defer bench.CPU(b)()
		i := 0
		for b.Loop() {
			i++
			id := "1"
			if fresh {
				id = strconv.Itoa(i)
			}
			if code := do(id); code != http.StatusOK {
				b.Fatalf("status %d", code)
			}
		}
	}
	for _, c := range cases {
		b.Run("in-process/"+c.name, func(b *testing.B) {
			h := receiver(b, c.fn())
			loop(b, c.fresh, func(id string) int {
				w := httptest.NewRecorder()
				h.ServeHTTP(w, deliveryRequest("/", id))
				return w.Code
			})
		})
	}
	for _, c := range cases {
		b.Run("framework-tcp/"+c.name, func(b *testing.B) {
			serve(b, c.fn())
			loop(b, c.fresh, func(id string) int {
				resp, err := http.DefaultClient.Do(deliveryRequest(serverURL+"/", id))
				if err != nil {
					b.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				return resp.StatusCode
			})
		})
	}
}

// BenchmarkLock measures Lock on fake.Store, which does no I/O, beside the
// two store calls it makes (Claim, then Complete) called directly, at 1
// and 16 workers: what Lock itself adds to a delivery.
func BenchmarkLock(b *testing.B) {
	for _, workers := range []int{1, 16} {
		for _, kind := range []string{"store-calls", "lock"} {
			b.Run(fmt.Sprintf("fake/%s/workers=%d", kind, workers), func(b *testing.B) {
				s := fake.New()
				ctx := context.Background()
				body := func(context.Context) error { return nil }
				b.ReportAllocs()
				defer bench.CPU(b)()
				bench.Deliveries(b, workers, func(key string) error {
					if kind == "lock" {
						return idempotency.Lock(ctx, s, key, body)
					}
					res, err := s.Claim(ctx, key, store.DefaultLease)
					if err != nil {
						return err
					}
					_, err = s.Complete(ctx, res.Claim)
					return err
				})
			})
		}
	}
}

// maxWrapperAllocs is the most allocations Idempotent on fake.Store may add
// to one fresh delivery through the CloudEvents handler: 19, the payload
// fingerprint's string included. One encoding/json decode of the envelope
// reads the message id and hashes the data for the default key and
// fingerprint, and costs about 10 of them (the decoder's state, its
// parse stack and field-error context, the envelope and message structs,
// the id); the rest are the claim's context, the settle timeout's context
// and the store's record and token.
const maxWrapperAllocs = 19

// TestWrapperAllocations pins what the wrapper adds to a fresh delivery
// through the CloudEvents HTTP handler: at most maxWrapperAllocs
// allocations (the envelope's decode, the payload fingerprint, the claim's
// context, the settle timeout's context and the store's record), measured
// beside the unwrapped handler.
func TestWrapperAllocations(t *testing.T) {
	allocs := func(fn idempotency.CloudEventFunc) float64 {
		h := receiver(t, fn)
		i := 0
		return testing.AllocsPerRun(500, func() {
			i++
			w := httptest.NewRecorder()
			h.ServeHTTP(w, deliveryRequest("/", strconv.Itoa(i)))
			if w.Code != http.StatusOK {
				t.Fatalf("status %d", w.Code)
			}
		})
	}
	plain := allocs(noop)
	wrapped := allocs(idempotency.Idempotent(fake.New(), idempotency.WithLogger(quiet))(noop))
	t.Logf("%.1f allocations unwrapped, %.1f wrapped", plain, wrapped)
	if wrapped-plain > maxWrapperAllocs+raceAllocSlack {
		t.Fatalf("the wrapper adds %.1f allocations per delivery (%.1f against %.1f), want at most %d", wrapped-plain, wrapped, plain, maxWrapperAllocs)
	}
}

// BenchmarkPayloadFingerprint measures the default fingerprint alone on a
// delivery's event, for messages of 100 bytes and 64 KiB of data.
func BenchmarkPayloadFingerprint(b *testing.B) {
	for _, size := range []int{100, 64 << 10} {
		b.Run(fmt.Sprintf("data=%dB", size), func(b *testing.B) {
			data := base64.StdEncoding.EncodeToString(bytes.Repeat([]byte("x"), size))
			e := cloudevents.NewEvent()
			e.SetID("1")
			e.SetType(idempotency.PubSubEventType)
			e.SetSource("//pubsub.googleapis.com/projects/p/topics/t")
			if err := e.SetData(cloudevents.ApplicationJSON, []byte(`{"message":{"attributes":{"po_id":"PO-1"},"data":"`+data+`","messageId":"1"},"subscription":"s"}`)); err != nil {
				b.Fatal(err)
			}
			fp := idempotency.PayloadFingerprint()
			b.ReportAllocs()
			b.SetBytes(int64(size))
			for b.Loop() {
				if s, err := fp(e); err != nil || s == "" {
					b.Fatal(s, err)
				}
			}
		})
	}
}
