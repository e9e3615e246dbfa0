package idempotency_test

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
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

// An Eventarc event that is not a Pub/Sub message (a Cloud Storage event
// to a Cloud Run service) is keyed by its source and id under the default
// key: the first delivery runs, a redelivery is acked unrun. Before the
// default keyed such events, they were refused with 400.
func TestPushHandlerKeysANonPubSubEventBySourceAndID(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	l, logger := newLogs()
	srv := httptest.NewServer(idempotency.PushHandler(s, h.handle, idempotency.WithLogger(logger)))
	defer srv.Close()
	for i := range 2 {
		if code := pushTo(t, srv.URL, "eventarc_storage"); code != http.StatusNoContent {
			t.Fatalf("delivery %d: HTTP %d, want 204", i+1, code)
		}
	}
	if h.runs() != 1 {
		t.Fatalf("runs %d, want 1", h.runs())
	}
	if rec, ok := s.Record(storageEventKey); !ok || rec.State != store.Done {
		t.Fatalf("record %q: %+v %v, want done", storageEventKey, rec, ok)
	}
	if len(l.find(t, "INFO", "duplicate delivery acknowledged")) != 1 {
		t.Fatalf("logs %v, want one duplicate", l.records(t))
	}
	// The same event under MessageID, which reads only Pub/Sub messages:
	// refused as malformed, nothing run or stored.
	s2, _ := newStore(t)
	srv2 := httptest.NewServer(idempotency.PushHandler(s2, h.handle, idempotency.WithLogger(logger), idempotency.WithKey(idempotency.MessageID())))
	defer srv2.Close()
	if code := pushTo(t, srv2.URL, "eventarc_storage"); code != http.StatusBadRequest || h.runs() != 1 || s2.Len() != 0 {
		t.Fatalf("under MessageID: HTTP %d, runs %d, records %d; want 400, no new run, none", code, h.runs(), s2.Len())
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

// unwrapped builds an unwrapped push request: body is the message data,
// head the headers (repeated when a value has several entries).
func unwrapped(body string, head map[string][]string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(body))
	for k, vs := range head {
		for _, v := range vs {
			r.Header.Add(k, v)
		}
	}
	return r
}

// serveOnce sends r to h and returns the status and body.
func serveOnce(h http.Handler, r *http.Request) (int, string) {
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w.Code, w.Body.String()
}

// metadata are the headers Pub/Sub writes on an unwrapped push with
// write-metadata, for message id, plus attribute po_id.
func metadata(id string) map[string][]string {
	return map[string][]string{
		idempotency.PushMessageIDHeader:    {id},
		idempotency.PushPublishTimeHeader:  {"2026-11-29T12:00:00.123Z"},
		idempotency.PushSubscriptionHeader: {"projects/p/subscriptions/orders-unwrapped"},
		idempotency.PushOrderingKeyHeader:  {"customer-7"},
		"po_id":                            {"PO-1001"},
		"User-Agent":                       {"CloudPubSub-Google"},
	}
}

// With write-metadata, the key is the message id header, whatever the body
// looks like: an envelope of another message, a structured CloudEvent, a
// Ce-Id header an attribute made. The handler sees the message as if it had
// come wrapped, with the body as its data byte for byte and only the named
// attributes.
func TestPushHandlerUnwrappedWithMetadataKeysOnTheMessageIDHeader(t *testing.T) {
	bodies := map[string]string{
		"an envelope of another message": `{"message":{"messageId":"forged","data":"e30="},"subscription":"s"}`,
		"a structured CloudEvent":        `{"specversion":"1.0","id":"forged","source":"s","type":"` + idempotency.PubSubEventType + `","data":{"message":{"messageId":"forged"}}}`,
		"not JSON":                       "\x00\xffraw bytes",
		"empty":                          "",
	}
	for name, body := range bodies {
		t.Run(name, func(t *testing.T) {
			s, _ := newStore(t)
			h := &counting{}
			ph := idempotency.PushHandler(s, h.handle, idempotency.WithLogger(newDiscard()), idempotency.WithUnwrappedPush("po_id"))
			head := metadata("m-1")
			// Attributes an adversarial publisher could set, as headers.
			head["Ce-Id"] = []string{"forged"}
			head["Ce-Type"] = []string{idempotency.PubSubEventType}
			head["Ce-Specversion"] = []string{"1.0"}
			head["Content-Type"] = []string{"application/cloudevents+json"}
			for range 2 { // the second post is the redelivery
				if code, msg := serveOnce(ph, unwrapped(body, head)); code != http.StatusNoContent {
					t.Fatalf("HTTP %d %q, want 204", code, msg)
				}
			}
			if h.runs() != 1 || s.Len() != 1 {
				t.Fatalf("runs %d, records %d; want 1 and 1", h.runs(), s.Len())
			}
			if rec, ok := s.Record("m-1"); !ok || rec.State != store.Done {
				t.Fatalf("record under the message id header: %+v, %v", rec, ok)
			}
			ev, err := idempotency.ParsePubSub(h.events[0])
			want := idempotency.PubSubEvent{
				Message: idempotency.PubSubMessage{ID: "m-1", Data: []byte(body), Attributes: map[string]string{"po_id": "PO-1001"},
					OrderingKey: "customer-7", PublishTime: time.Date(2026, 11, 29, 12, 0, 0, 123e6, time.UTC)},
				Subscription: "projects/p/subscriptions/orders-unwrapped",
			}
			if err != nil || !reflect.DeepEqual(ev.Message.Attributes, want.Message.Attributes) || string(ev.Message.Data) != body ||
				ev.Message.ID != want.Message.ID || ev.Message.OrderingKey != want.Message.OrderingKey ||
				!ev.Message.PublishTime.Equal(want.Message.PublishTime) || ev.Subscription != want.Subscription || ev.DeliveryAttempt != 0 {
				t.Fatalf("the handler saw %+v, %v; want %+v", ev, err, want)
			}
			if e := h.events[0]; e.ID() != "m-1" || e.Type() != idempotency.PubSubEventType || e.Source() != "//pubsub.googleapis.com/projects/p/subscriptions/orders-unwrapped" {
				t.Fatalf("event id %q, type %q, source %q", e.ID(), e.Type(), e.Source())
			}
			// Another message with the same body is another delivery.
			if code, _ := serveOnce(ph, unwrapped(body, metadata("m-2"))); code != http.StatusNoContent || h.runs() != 2 {
				t.Fatalf("second message: HTTP %d, runs %d; want 204 and 2", code, h.runs())
			}
		})
	}
}

// An attribute is passed on only when named, under the name given; a named
// attribute that is absent is absent; Attribute keys work on it.
func TestPushHandlerUnwrappedPassesOnlyTheNamedAttributes(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	ph := idempotency.PushHandler(s, h.handle, idempotency.WithLogger(newDiscard()),
		idempotency.WithUnwrappedPush("PO_ID", "Region"), idempotency.WithKey(idempotency.Attribute("PO_ID")))
	head := metadata("m-1") // carries po_id (lower case on the wire), no Region
	head["X-Cloud-Trace-Context"] = []string{"abc/1"}
	if code, msg := serveOnce(ph, unwrapped(`{}`, head)); code != http.StatusNoContent {
		t.Fatalf("HTTP %d %q", code, msg)
	}
	ev, _ := idempotency.ParsePubSub(h.events[0])
	if !reflect.DeepEqual(ev.Message.Attributes, map[string]string{"PO_ID": "PO-1001"}) {
		t.Fatalf("attributes %v, want only PO_ID", ev.Message.Attributes)
	}
	if _, ok := s.Record("PO-1001"); !ok {
		t.Fatal("Attribute(\"PO_ID\") did not key on the header")
	}
}

// Without write-metadata there is no message id: the default key refuses
// every delivery with a 400 that says what can work, and a payload key
// works.
func TestPushHandlerUnwrappedWithoutMetadataNeedsAPayloadKey(t *testing.T) {
	body := `{"order":{"id":"PO-7","qty":1}}`
	t.Run("default key", func(t *testing.T) {
		h := &counting{}
		l, logger := newLogs()
		ph := idempotency.PushHandler(untouchable(t), h.handle, idempotency.WithLogger(logger), idempotency.WithUnwrappedPush())
		code, msg := serveOnce(ph, unwrapped(body, map[string][]string{"Content-Type": {"application/json"}}))
		if code != http.StatusBadRequest || h.runs() != 0 {
			t.Fatalf("HTTP %d, runs %d; want 400 and none", code, h.runs())
		}
		for _, want := range []string{"has no key", idempotency.PushMessageIDHeader, "--push-no-wrapper-write-metadata", "WithKey(JSONField("} {
			if !strings.Contains(msg, want) {
				t.Errorf("the refusal %q does not say %q", msg, want)
			}
		}
		if len(l.find(t, "ERROR", "nacking")) != 1 {
			t.Fatalf("logs %v, want one error", l.records(t))
		}
	})
	t.Run("JSONField", func(t *testing.T) {
		s, _ := newStore(t)
		h := &counting{}
		ph := idempotency.PushHandler(s, h.handle, idempotency.WithLogger(newDiscard()),
			idempotency.WithUnwrappedPush(), idempotency.WithKey(idempotency.JSONField("order", "id")))
		for range 2 {
			if code, msg := serveOnce(ph, unwrapped(body, nil)); code != http.StatusNoContent {
				t.Fatalf("HTTP %d %q, want 204", code, msg)
			}
		}
		if h.runs() != 1 || s.Len() != 1 {
			t.Fatalf("runs %d, records %d; want 1 and 1", h.runs(), s.Len())
		}
		if _, ok := s.Record("PO-7"); !ok {
			t.Fatal("no record under the payload key")
		}
		if e := h.events[0]; e.Type() == idempotency.PubSubEventType {
			t.Fatalf("an event without a message id has the type %q, under which MessageID would key on its placeholder id %q", e.Type(), e.ID())
		}
		code, msg := serveOnce(ph, unwrapped(`{"order":{}}`, nil))
		if code != http.StatusBadRequest || !strings.Contains(msg, "the configured key found none") || h.runs() != 1 {
			t.Fatalf("payload without the field: HTTP %d %q, runs %d; want 400 naming the key", code, msg, h.runs())
		}
	})
}

// A metadata or named attribute header that is repeated or not UTF-8 has
// no single value to key on: 400, nothing claimed, nothing run.
func TestPushHandlerUnwrappedRefusesAmbiguousHeaders(t *testing.T) {
	cases := map[string]map[string][]string{
		"message id repeated":    {idempotency.PushMessageIDHeader: {"m-1", "m-2"}},
		"message id not UTF-8":   {idempotency.PushMessageIDHeader: {"m-\xff"}},
		"subscription repeated":  {idempotency.PushMessageIDHeader: {"m-1"}, idempotency.PushSubscriptionHeader: {"a", "b"}},
		"ordering key not UTF-8": {idempotency.PushMessageIDHeader: {"m-1"}, idempotency.PushOrderingKeyHeader: {"\xfe"}},
		"attribute repeated":     {idempotency.PushMessageIDHeader: {"m-1"}, "po_id": {"a", "b"}},
		"attribute not UTF-8":    {idempotency.PushMessageIDHeader: {"m-1"}, "po_id": {"\xff"}},
	}
	for name, head := range cases {
		t.Run(name, func(t *testing.T) {
			h := &counting{}
			ph := idempotency.PushHandler(untouchable(t), h.handle, idempotency.WithLogger(newDiscard()), idempotency.WithUnwrappedPush("po_id"))
			if code, msg := serveOnce(ph, unwrapped("{}", head)); code != http.StatusBadRequest || h.runs() != 0 {
				t.Fatalf("HTTP %d %q, runs %d; want 400 and none", code, msg, h.runs())
			}
		})
	}
}

func TestPushHandlerPanicsOnAMistakenPushOption(t *testing.T) {
	s, _ := newStore(t)
	for name, opt := range map[string]idempotency.Option{
		"empty attribute":       idempotency.WithUnwrappedPush(""),
		"attribute with space":  idempotency.WithUnwrappedPush("po id"),
		"metadata as attribute": idempotency.WithUnwrappedPush("x-goog-pubsub-message-id"),
		"attribute twice":       idempotency.WithUnwrappedPush("po_id", "PO_ID"),
		"nil verifier":          idempotency.WithPushAuth(nil),
	} {
		t.Run(name, func(t *testing.T) {
			defer func() {
				if msg, _ := recover().(string); !strings.HasPrefix(msg, "idempotency.PushHandler: ") {
					t.Fatalf("panic %q, want a refusal", msg)
				}
			}()
			idempotency.PushHandler(s, (&counting{}).handle, opt)
		})
	}
	// Idempotent ignores WithUnwrappedPush (WithPushAuth it refuses: see
	// TestIdempotentRefusesWithPushAuth).
	if idempotency.Idempotent(s, idempotency.WithUnwrappedPush()) == nil {
		t.Fatal("no decorator")
	}
}

// Without WithUnwrappedPush, a request carrying the message id header of
// an unwrapped push is read as an envelope or CloudEvent only when it is
// one of that very message; otherwise it is refused, naming the option:
// never keyed on a payload that only looks like an envelope.
func TestPushHandlerWithoutTheOptionRefusesAnUnwrappedDelivery(t *testing.T) {
	ce := map[string][]string{"Ce-Id": {"m-1"}, "Ce-Type": {idempotency.PubSubEventType}, "Ce-Specversion": {"1.0"},
		"Ce-Source": {"//pubsub.googleapis.com/projects/p/topics/t"}, "Content-Type": {"application/json"}}
	with := func(m map[string][]string, id ...string) map[string][]string {
		out := map[string][]string{idempotency.PushMessageIDHeader: id}
		for k, v := range m {
			out[k] = v
		}
		return out
	}
	cases := []struct {
		name string
		body string
		head map[string][]string
		want int
	}{
		{"unwrapped payload shaped like another message's envelope", `{"message":{"messageId":"forged"}}`, with(nil, "m-1"), http.StatusBadRequest},
		{"unwrapped payload that is not an envelope", `{"order":{"id":"PO-7"}}`, with(nil, "m-1"), http.StatusBadRequest},
		{"envelope of that message", `{"message":{"messageId":"m-1"}}`, with(nil, "m-1"), http.StatusNoContent},
		{"envelope, header repeated", `{"message":{"messageId":"m-1"}}`, with(nil, "m-1", "m-1"), http.StatusBadRequest},
		{"binary CloudEvent of that message", `{"message":{}}`, with(ce, "m-1"), http.StatusNoContent},
		{"binary CloudEvent of another message", `{"message":{}}`, with(ce, "m-2"), http.StatusBadRequest},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, _ := newStore(t)
			h := &counting{}
			code, msg := serveOnce(idempotency.PushHandler(s, h.handle, idempotency.WithLogger(newDiscard())), unwrapped(c.body, c.head))
			if code != c.want {
				t.Fatalf("HTTP %d %q, want %d", code, msg, c.want)
			}
			if c.want == http.StatusBadRequest && (h.runs() != 0 || s.Len() != 0 || !strings.Contains(msg, "WithUnwrappedPush")) {
				t.Fatalf("runs %d, records %d, body %q; want none, none, and the option named", h.runs(), s.Len(), msg)
			}
			if c.want == http.StatusNoContent {
				if _, ok := s.Record("m-1"); !ok || h.runs() != 1 {
					t.Fatalf("runs %d; want one, keyed m-1", h.runs())
				}
			}
		})
	}
}

// The functions framework cannot serve an unwrapped subscription: an
// unwrapped payload posted to a framework function is refused with a 400
// and never runs (the framework reads the body as an envelope).
func TestFrameworkRefusesAnUnwrappedPush(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s, idempotency.WithLogger(newDiscard()), idempotency.WithUnwrappedPush())(h.handle))
	req, _ := http.NewRequest(http.MethodPost, serverURL+"/", strings.NewReader(`{"order":{"id":"PO-7"}}`))
	req.Header = metadata("m-1")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || h.runs() != 0 || s.Len() != 0 {
		t.Fatalf("HTTP %d, runs %d, records %d; want 400, none, none", resp.StatusCode, h.runs(), s.Len())
	}
}

// WithPushAuth: the verifier sees every request before its body is read;
// a refusal is a 401 (403 for ErrPushForbidden), the backend is never
// called and the handler never runs; an accepted request is guarded as
// usual.
func TestPushHandlerWithPushAuth(t *testing.T) {
	verify := func(r *http.Request) error {
		switch r.Header.Get("Authorization") {
		case "Bearer good":
			return nil
		case "Bearer other-account":
			return fmt.Errorf("token of other@p.iam.gserviceaccount.com: %w", idempotency.ErrPushForbidden)
		}
		return errors.New("no valid token")
	}
	body := `{"message":{"messageId":"m-1"}}`
	for _, c := range []struct {
		auth string
		want int
	}{
		{"", http.StatusUnauthorized},
		{"Bearer forged", http.StatusUnauthorized},
		{"Bearer other-account", http.StatusForbidden},
	} {
		t.Run(c.auth, func(t *testing.T) {
			h := &counting{}
			l, logger := newLogs()
			ph := idempotency.PushHandler(untouchable(t), h.handle, idempotency.WithLogger(logger), idempotency.WithPushAuth(verify))
			r := httptest.NewRequest(http.MethodPost, "/", unreadable{t})
			if c.auth != "" {
				r.Header.Set("Authorization", c.auth)
			}
			w := httptest.NewRecorder()
			ph.ServeHTTP(w, r)
			if w.Code != c.want || h.runs() != 0 {
				t.Fatalf("HTTP %d, runs %d; want %d and none", w.Code, h.runs(), c.want)
			}
			if got := w.Header().Get("WWW-Authenticate"); (c.want == http.StatusUnauthorized) != (got == "Bearer") {
				t.Fatalf("WWW-Authenticate %q on a %d", got, w.Code)
			}
			if len(l.find(t, "WARN", "unauthenticated push")) != 1 {
				t.Fatalf("logs %v, want one warning", l.records(t))
			}
			// The body says only the status; the detail (which account
			// is expected, what was wrong) goes to the log alone.
			if got, want := w.Body.String(), http.StatusText(c.want)+"\n"; got != want {
				t.Fatalf("body %q, want %q", got, want)
			}
			if c.want == http.StatusForbidden && !strings.Contains(fmt.Sprint(l.records(t)), "other@p.iam.gserviceaccount.com") {
				t.Fatalf("the 403's detail is not in the log: %v", l.records(t))
			}
		})
	}
	s, _ := newStore(t)
	h := &counting{}
	ph := idempotency.PushHandler(s, h.handle, idempotency.WithLogger(newDiscard()), idempotency.WithPushAuth(verify))
	for range 2 {
		if code := send(t, ph, body, map[string]string{"Authorization": "Bearer good"}); code != http.StatusNoContent {
			t.Fatalf("HTTP %d, want 204", code)
		}
	}
	if h.runs() != 1 || s.Len() != 1 {
		t.Fatalf("runs %d, records %d; want 1 and 1", h.runs(), s.Len())
	}
}

// unreadable is a request body that fails the test when read.
type unreadable struct{ t *testing.T }

func (u unreadable) Read([]byte) (int, error) {
	u.t.Error("the body of a refused request was read")
	return 0, io.EOF
}

// An Attribute key on an attribute WithUnwrappedPush does not name finds
// nothing: the 400 says why.
func TestPushHandlerUnwrappedAttributeKeyNeedsTheAttributeNamed(t *testing.T) {
	h := &counting{}
	ph := idempotency.PushHandler(untouchable(t), h.handle, idempotency.WithLogger(newDiscard()),
		idempotency.WithUnwrappedPush(), idempotency.WithKey(idempotency.Attribute("po_id")))
	code, msg := serveOnce(ph, unwrapped("{}", metadata("m-1")))
	if code != http.StatusBadRequest || h.runs() != 0 || !strings.Contains(msg, "only when WithUnwrappedPush names it") {
		t.Fatalf("HTTP %d %q, runs %d; want a 400 naming the option", code, msg, h.runs())
	}
}

// BenchmarkPushHandlerShapes: one fresh delivery per iteration through
// PushHandler on the fake store, as a wrapped envelope, as an unwrapped
// push with write-metadata (WithUnwrappedPush), and as an envelope behind
// WithPushAuth with a verifier that accepts at once (the option's own cost,
// not a token check's: pushauth's is measured in its module).
func BenchmarkPushHandlerShapes(b *testing.B) {
	data := `{"order":{"id":"PO-1","qty":3}}`
	envelope := func(id string) *http.Request {
		body := `{"message":{"messageId":"` + id + `","data":"` + base64.StdEncoding.EncodeToString([]byte(data)) +
			`","attributes":{"po_id":"PO-1"}},"subscription":"projects/p/subscriptions/s"}`
		return unwrapped(body, map[string][]string{"Content-Type": {"application/json"}})
	}
	ok := func(context.Context, cloudevents.Event) error { return nil }
	shapes := []struct {
		name string
		opts []idempotency.Option
		req  func(id string) *http.Request
	}{
		{"envelope", nil, envelope},
		{"unwrapped", []idempotency.Option{idempotency.WithUnwrappedPush("po_id")}, func(id string) *http.Request {
			return unwrapped(data, metadata(id))
		}},
		{"envelope+WithPushAuth", []idempotency.Option{idempotency.WithPushAuth(func(*http.Request) error { return nil })}, envelope},
	}
	for _, sh := range shapes {
		b.Run(sh.name, func(b *testing.B) {
			s := fake.New()
			ph := idempotency.PushHandler(s, ok, append([]idempotency.Option{idempotency.WithLogger(newDiscard())}, sh.opts...)...)
			i := 0
			for b.Loop() {
				i++
				w := httptest.NewRecorder()
				ph.ServeHTTP(w, sh.req(strconv.Itoa(i)))
				if w.Code != http.StatusNoContent {
					b.Fatalf("HTTP %d %s", w.Code, w.Body)
				}
			}
		})
	}
}
