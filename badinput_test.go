package idempotency_test

// Tests that pin rows of docs/bad-input.md not pinned elsewhere.

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// send posts body with the given headers to h and returns the status.
func send(t *testing.T, h http.Handler, body string, head map[string]string) int {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(body))
	for k, v := range head {
		r.Header.Set(k, v)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w.Code
}

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

func TestCancelledContexts(t *testing.T) {
	e := func(t *testing.T) cloudevents.Event { return pubsubEvent(t, "m-1", map[string]any{"messageId": "m-1"}) }
	t.Run("before the claim: nack, handler not run, nothing written", func(t *testing.T) {
		s, _ := newStore(t)
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		err := idempotency.Idempotent(s)(func(context.Context, cloudevents.Event) error { t.Error("ran"); return nil })(ctx, e(t))
		if !errors.Is(err, context.Canceled) || s.Len() != 0 {
			t.Fatalf("err %v, records %d; want context.Canceled and none", err, s.Len())
		}
		r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(`{"message":{"messageId":"m-1"}}`)).WithContext(ctx)
		w := httptest.NewRecorder()
		idempotency.PushHandler(s, func(context.Context, cloudevents.Event) error { t.Error("ran"); return nil },
			idempotency.WithLogger(newDiscard())).ServeHTTP(w, r)
		if w.Code != http.StatusInternalServerError || s.Len() != 0 {
			t.Fatalf("PushHandler: HTTP %d, records %d; want 500 and none", w.Code, s.Len())
		}
	})
	t.Run("during the body: the body's error, released on a detached context", func(t *testing.T) {
		s, _ := newStore(t)
		ctx, cancel := context.WithCancel(t.Context())
		err := idempotency.Idempotent(s)(func(ctx context.Context, _ cloudevents.Event) error {
			cancel()
			return ctx.Err()
		})(ctx, e(t))
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("err %v, want the body's context.Canceled", err)
		}
		assertReleased(t, s, "m-1")
	})
	t.Run("after the body: completed on a detached context, acked", func(t *testing.T) {
		s, _ := newStore(t)
		ctx, cancel := context.WithCancel(t.Context())
		err := idempotency.Idempotent(s)(func(context.Context, cloudevents.Event) error { cancel(); return nil })(ctx, e(t))
		if rec, _ := s.Record("m-1"); err != nil || rec.State != store.Done {
			t.Fatalf("err %v, record %+v; want nil and done", err, rec)
		}
	})
}

// Through the functions framework: what the framework hands Idempotent for
// a wrong content type or an empty body, and what goes back.
func TestHTTPContentTypeAndEmptyBody(t *testing.T) {
	raw := `{"message":{"messageId":"m-1","data":"e30="}}`
	cases := []struct {
		name string
		body string
		head map[string]string
		want int
		runs int
	}{
		{"binary CloudEvent, data as text/plain", raw, map[string]string{"Content-Type": "text/plain", "Ce-Id": "m-1",
			"Ce-Type": idempotency.PubSubEventType, "Ce-Specversion": "1.0", "Ce-Source": "//pubsub.googleapis.com/projects/p/topics/t"}, 200, 1},
		{"binary CloudEvent with no data", "", map[string]string{"Ce-Id": "m-1",
			"Ce-Type": idempotency.PubSubEventType, "Ce-Specversion": "1.0", "Ce-Source": "//pubsub.googleapis.com/projects/p/topics/t"}, 500, 0},
		{"empty body, no headers", "", nil, 400, 0},
		{"empty structured CloudEvent", "", map[string]string{"Content-Type": "application/cloudevents+json"}, 500, 0},
		{"raw envelope as text/plain", raw, map[string]string{"Content-Type": "text/plain"}, 200, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, _ := newStore(t)
			h := &counting{}
			serve(t, idempotency.Idempotent(s, idempotency.WithLogger(newDiscard()))(h.handle))
			req, err := http.NewRequest(http.MethodPost, serverURL+"/projects/p/topics/t", bytes.NewReader([]byte(c.body)))
			if err != nil {
				t.Fatal(err)
			}
			for k, v := range c.head {
				req.Header.Set(k, v)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != c.want || h.runs() != c.runs {
				t.Fatalf("HTTP %d %q, runs %d; want %d and %d runs", resp.StatusCode, b, h.runs(), c.want, c.runs)
			}
		})
	}
}
