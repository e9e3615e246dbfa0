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
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

func TestPushHandlerHostileMessageIDs(t *testing.T) {
	long := strings.Repeat("k", store.MaxKeyLen)
	cases := []struct {
		name, id string
		want     int
		runs     int
	}{
		{"NUL", `a\u0000b`, http.StatusBadRequest, 0},
		{"over MaxKeyLen", long + "k", http.StatusBadRequest, 0},
		{"1 KiB", long, http.StatusNoContent, 1},
		{"invalid UTF-8 becomes U+FFFD", "\xff\xfe", http.StatusNoContent, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, _ := newStore(t)
			h := &counting{}
			ph := idempotency.PushHandler(s, h.handle, idempotency.WithLogger(newDiscard()))
			body := `{"message":{"messageId":"` + c.id + `"}}`
			for range 2 { // the second post is the redelivery
				if code := send(t, ph, body, map[string]string{"Content-Type": "application/json"}); code != c.want {
					t.Fatalf("HTTP %d, want %d", code, c.want)
				}
			}
			if h.runs() != c.runs || s.Len() != c.runs {
				t.Fatalf("runs %d, records %d; want %d", h.runs(), s.Len(), c.runs)
			}
			if c.name == "invalid UTF-8 becomes U+FFFD" {
				if _, ok := s.Record("\ufffd\ufffd"); !ok {
					t.Fatal("the JSON decoder's replacement is not the key")
				}
			}
		})
	}
}

func TestPushHandlerContentTypeAndEmptyBody(t *testing.T) {
	raw := `{"message":{"messageId":"m-1","data":"e30="}}`
	pubsubCE := map[string]string{"Ce-Id": "m-1", "Ce-Type": idempotency.PubSubEventType, "Ce-Specversion": "1.0", "Ce-Source": "//pubsub.googleapis.com/projects/p/topics/t"}
	with := func(m map[string]string, k, v string) map[string]string {
		out := map[string]string{k: v}
		for a, b := range m {
			out[a] = b
		}
		return out
	}
	cases := []struct {
		name string
		body string
		head map[string]string
		want int
	}{
		{"envelope as text/plain: the body decides", raw, map[string]string{"Content-Type": "text/plain"}, http.StatusNoContent},
		{"envelope without a content type", raw, nil, http.StatusNoContent},
		{"envelope labelled a structured CloudEvent", raw, map[string]string{"Content-Type": "application/cloudevents+json"}, http.StatusBadRequest},
		{"envelope labelled a CloudEvent batch", raw, map[string]string{"Content-Type": "application/cloudevents-batch+json"}, http.StatusBadRequest},
		{"binary CloudEvent, data as text/plain", raw, with(pubsubCE, "Content-Type", "text/plain"), http.StatusNoContent},
		{"empty body", "", map[string]string{"Content-Type": "application/json"}, http.StatusBadRequest},
		{"empty body, no content type", "", nil, http.StatusBadRequest},
		{"binary CloudEvent with no data", "", pubsubCE, http.StatusBadRequest},
		{"structured CloudEvent, empty", "", map[string]string{"Content-Type": "application/cloudevents+json"}, http.StatusBadRequest},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, _ := newStore(t)
			h := &counting{}
			code := send(t, idempotency.PushHandler(s, h.handle, idempotency.WithLogger(newDiscard())), c.body, c.head)
			if code != c.want {
				t.Fatalf("HTTP %d, want %d", code, c.want)
			}
			if want := map[bool]int{true: 1, false: 0}[c.want == http.StatusNoContent]; h.runs() != want {
				t.Fatalf("runs %d, want %d", h.runs(), want)
			}
		})
	}
}

func TestPushHandlerNonPubSubEventUnderTheDefaultKey(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	l, logger := newLogs()
	srv := httptest.NewServer(idempotency.PushHandler(s, h.handle, idempotency.WithLogger(logger)))
	defer srv.Close()
	if code := pushTo(t, srv.URL, "unkeyed"); code != http.StatusBadRequest || h.runs() != 0 || s.Len() != 0 {
		t.Fatalf("HTTP %d, runs %d, records %d; want 400, none, none", code, h.runs(), s.Len())
	}
	if len(l.find(t, "ERROR", "nacking")) != 1 {
		t.Fatalf("logs %v, want one error", l.records(t))
	}
}

func TestPushHandlerBodyErrorWrappingErrDuplicateIsNotAcked(t *testing.T) {
	s, _ := newStore(t)
	completeSubKey(t, s, "po:PO-1")
	ran := 0
	var dups int
	l, logger := newLogs()
	srv := httptest.NewServer(idempotency.PushHandler(s, nestedDuplicate(s, &ran), idempotency.WithLogger(logger),
		idempotency.OnDuplicate(func(context.Context, string) error { dups++; return nil })))
	defer srv.Close()
	if code := pushTo(t, srv.URL, "push_raw"); code != http.StatusInternalServerError {
		t.Fatalf("HTTP %d, want 500 (nack)", code)
	}
	if dups != 0 || len(l.find(t, "INFO", "handler not run")) != 0 || len(l.find(t, "ERROR", "nacking")) != 1 {
		t.Fatalf("hook calls %d, logs %v; want no duplicate and one nack error", dups, l.records(t))
	}
	assertReleased(t, s, fixtureID)
	if code := pushTo(t, srv.URL, "push_raw"); code != http.StatusInternalServerError || ran != 2 {
		t.Fatalf("redelivery: HTTP %d, runs %d; want 500 and 2", code, ran)
	}
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
