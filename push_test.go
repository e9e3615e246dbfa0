package idempotency_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"

	"github.com/gcp-pubsub-idempotency/idempotency"
)

// pushTo posts a fixture to a PushHandler server.
func pushTo(t *testing.T, url, name string) int {
	t.Helper()
	code, _ := postTo(t, url, name)
	return code
}

func TestPushHandlerAcceptsEveryShapeAndDeduplicates(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	srv := httptest.NewServer(idempotency.PushHandler(s, h.handle, idempotency.WithLogger(newDiscard())))
	defer srv.Close()
	for _, name := range []string{"push_raw", "eventarc_binary", "eventarc_structured", "push_raw"} {
		if code := pushTo(t, srv.URL, name); code != http.StatusNoContent {
			t.Fatalf("%s: HTTP %d, want 204 (ack)", name, code)
		}
	}
	if h.runs() != 1 {
		t.Fatalf("handler ran %d times, want 1", h.runs())
	}
	// Unlike the functions framework, the raw push keeps subscription
	// (and deliveryAttempt, when the subscription has a dead-letter policy).
	ev, err := idempotency.ParsePubSub(h.events[0])
	if err != nil || ev.Subscription != "projects/my-project/subscriptions/orders-push" || ev.Message.ID != "11223344556677" ||
		ev.Message.Attributes["po_id"] != "PO-1001" || !ev.Message.PublishTime.Equal(time.Date(2026, 11, 29, 12, 0, 0, 123e6, time.UTC)) {
		t.Fatalf("the handler saw %+v, %v", ev, err)
	}
}

func TestPushHandlerKeepsTheDeliveryAttempt(t *testing.T) {
	s, _ := newStore(t)
	var attempt int
	srv := httptest.NewServer(idempotency.PushHandler(s, func(ctx context.Context, e cloudevents.Event) error {
		ev, _ := idempotency.ParsePubSub(e)
		attempt = ev.DeliveryAttempt
		return nil
	}))
	defer srv.Close()
	body := `{"message":{"messageId":"m-9","data":"e30="},"subscription":"projects/p/subscriptions/s","deliveryAttempt":7}`
	resp, err := http.Post(srv.URL, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent || attempt != 7 {
		t.Fatalf("HTTP %d, deliveryAttempt %d; want 204 and 7", resp.StatusCode, attempt)
	}
}

func TestPushHandlerStatuses(t *testing.T) {
	cases := []struct {
		name    string
		handler idempotency.CloudEventFunc
		method  string
		body    string
		ctype   string
		want    int
	}{
		{name: "handler error", handler: func(context.Context, cloudevents.Event) error { return fmt.Errorf("boom") },
			body: `{"message":{"messageId":"a"}}`, want: http.StatusInternalServerError},
		{name: "handler's own status", handler: func(context.Context, cloudevents.Event) error { return cehttp.NewResult(429, "slow down") },
			body: `{"message":{"messageId":"b"}}`, want: 429},
		{name: "not JSON", body: `<xml/>`, want: http.StatusBadRequest},
		{name: "no message", body: `{"subscription":"s"}`, want: http.StatusBadRequest},
		{name: "no message id", body: `{"message":{"data":"e30="}}`, want: http.StatusBadRequest},
		{name: "bad CloudEvent", body: `{}`, ctype: "application/cloudevents+json", want: http.StatusBadRequest},
		{name: "GET", method: http.MethodGet, want: http.StatusMethodNotAllowed},
		{name: "too large", body: `{"message":{"messageId":"c","data":"` + strings.Repeat("A", idempotency.MaxPushBody) + `"}}`, want: http.StatusRequestEntityTooLarge},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, _ := newStore(t)
			h := c.handler
			ran := false
			if h == nil {
				h = func(context.Context, cloudevents.Event) error { ran = true; return nil }
			}
			srv := httptest.NewServer(idempotency.PushHandler(s, h, idempotency.WithLogger(newDiscard())))
			defer srv.Close()
			method := c.method
			if method == "" {
				method = http.MethodPost
			}
			req, _ := http.NewRequest(method, srv.URL, strings.NewReader(c.body))
			ctype := c.ctype
			if ctype == "" {
				ctype = "application/json"
			}
			req.Header.Set("Content-Type", ctype)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != c.want || ran {
				t.Fatalf("HTTP %d (handler ran: %v), want %d", resp.StatusCode, ran, c.want)
			}
		})
	}
}

func TestPushHandlerContentionIs503(t *testing.T) {
	s, _ := newStore(t)
	s.Claim(t.Context(), "11223344556677", time.Hour)
	h := &counting{}
	srv := httptest.NewServer(idempotency.PushHandler(s, h.handle, idempotency.WithLogger(newDiscard())))
	defer srv.Close()
	if code := pushTo(t, srv.URL, "push_raw"); code != http.StatusServiceUnavailable || h.runs() != 0 {
		t.Fatalf("HTTP %d, runs %d; want 503 and none", code, h.runs())
	}
}
