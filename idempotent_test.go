package idempotency_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"
	"github.com/cloudevents/sdk-go/v2/protocol"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

func TestHTTPEveryFixtureShapeIsKeyedByMessageID(t *testing.T) {
	for _, name := range []string{"eventarc_binary", "eventarc_structured", "push_raw"} {
		t.Run(name, func(t *testing.T) {
			s, _ := newStore(t)
			h := &counting{}
			serve(t, idempotency.Idempotent(s)(h.handle))
			if code, body := post(t, name); code != http.StatusOK {
				t.Fatalf("first delivery: %d %s", code, body)
			}
			if _, ok := s.Record("11223344556677"); !ok {
				t.Fatal("no record under the messageId")
			}
			if code, body := post(t, name); code != http.StatusOK {
				t.Fatalf("redelivery: %d %s, want 200 (ack)", code, body)
			}
			if h.runs() != 1 {
				t.Fatalf("handler ran %d times, want 1", h.runs())
			}
		})
	}
}

func TestHTTPDoubleSubscriptionProcessesOnce(t *testing.T) {
	// Eventarc's subscription and a plain push subscription on the same topic
	// deliver the same publish: one messageId, one run.
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s)(h.handle))
	for _, name := range []string{"eventarc_binary", "push_raw", "eventarc_structured"} {
		if code, body := post(t, name); code != http.StatusOK {
			t.Fatalf("%s: %d %s", name, code, body)
		}
	}
	if h.runs() != 1 {
		t.Fatalf("handler ran %d times across two subscriptions, want 1", h.runs())
	}
}

func TestHTTPHandlerErrorIs500AndTheRetrySucceeds(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{err: fmt.Errorf("supplier said 502")}
	serve(t, idempotency.Idempotent(s)(h.handle))
	if code, _ := post(t, "eventarc_binary"); code != http.StatusInternalServerError || returned() != h.err {
		t.Fatalf("failing handler: %d %v, want 500 and the handler's own error", code, returned())
	}
	h.mu.Lock()
	h.err = nil
	h.mu.Unlock()
	if code, _ := post(t, "eventarc_binary"); code != http.StatusOK {
		t.Fatalf("retry: %d", code)
	}
	if code, _ := post(t, "eventarc_binary"); code != http.StatusOK {
		t.Fatalf("duplicate after success: %d", code)
	}
	if h.runs() != 2 {
		t.Fatalf("runs = %d, want 2 (the failure and the success)", h.runs())
	}
}

func TestHTTPContentionIsAQuiet503WithTheDeliveryAttempt(t *testing.T) {
	s, _ := newStore(t)
	l, logger := newLogs()
	if _, err := s.Claim(t.Context(), "11223344556677", time.Hour); err != nil { // a live holder elsewhere
		t.Fatal(err)
	}
	h := &counting{}
	serve(t, idempotency.Idempotent(s, idempotency.WithLogger(logger))(h.handle))
	code, body := post(t, "eventarc_binary")
	if code != http.StatusServiceUnavailable || !errors.Is(returned(), idempotency.ErrInProgress) {
		t.Fatalf("contended delivery: %d %s %v, want 503 wrapping ErrInProgress", code, body, returned())
	}
	if h.runs() != 0 {
		t.Fatal("the handler ran under contention")
	}
	warns := l.find(t, "WARN", "in progress elsewhere")
	if len(warns) != 1 {
		t.Fatalf("want one warning, got %v", l.records(t))
	}
	w := warns[0]
	if w["key"] != "11223344556677" || w["delivery_attempt"] != float64(5) ||
		!strings.HasPrefix(w["subscription"].(string), "projects/my-project/subscriptions/") || w["until"] == nil {
		t.Fatalf("warning lacks key, delivery_attempt, subscription or until: %v", w)
	}
	if errs := l.find(t, "ERROR", ""); len(errs) != 0 {
		t.Fatalf("contention logged errors: %v", errs)
	}
}

func TestHTTPUnkeyedFailsClosedUnlessAllowed(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	byPO := idempotency.WithKey(idempotency.Attribute("po_id"))
	serve(t, idempotency.Idempotent(s, byPO)(h.handle))
	code, _ := post(t, "unkeyed")
	if code != http.StatusBadRequest || !errors.Is(returned(), idempotency.ErrNoKey) {
		t.Fatalf("unkeyed: %d %v, want 400 (a nack) and ErrNoKey", code, returned())
	}
	if h.runs() != 0 || s.Len() != 0 {
		t.Fatalf("runs=%d records=%d, want none", h.runs(), s.Len())
	}
	l, logger := newLogs()
	serve(t, idempotency.Idempotent(s, byPO, idempotency.AllowUnguarded(), idempotency.WithLogger(logger))(h.handle))
	if code, body := post(t, "unkeyed"); code != http.StatusOK {
		t.Fatalf("unkeyed with AllowUnguarded: %d %s", code, body)
	}
	if h.runs() != 1 || s.Len() != 0 || len(l.find(t, "WARN", "unguarded")) != 1 {
		t.Fatalf("runs=%d records=%d logs=%v; want 1 unguarded run with a warning", h.runs(), s.Len(), l.records(t))
	}
}

func TestHTTPMalformedDataIsRefused(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s, idempotency.AllowUnguarded())(h.handle))
	code, _ := post(t, "malformed")
	if code != http.StatusBadRequest || !errors.Is(returned(), idempotency.ErrMalformedEvent) {
		t.Fatalf("malformed: %d %v, want 400 (a nack) and ErrMalformedEvent", code, returned())
	}
	if h.runs() != 0 {
		t.Fatal("the handler ran on malformed data, even with AllowUnguarded")
	}
}

func TestHTTPBusinessKeyCatchesARepublish(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s,
		idempotency.WithKey(idempotency.Attribute("po_id")),
		idempotency.WithKeyPrefix("orders:"),
	)(h.handle))
	for _, name := range []string{"eventarc_binary", "republish"} {
		if code, body := post(t, name); code != http.StatusOK {
			t.Fatalf("%s: %d %s", name, code, body)
		}
	}
	if h.runs() != 1 {
		t.Fatalf("handler ran %d times for one order published twice, want 1", h.runs())
	}
	if _, ok := s.Record("orders:PO-1001"); !ok {
		t.Fatal("no record under the prefixed business key")
	}
}

func TestHTTPMessageIDDoesNotCatchARepublish(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s)(h.handle))
	post(t, "eventarc_binary")
	post(t, "republish")
	if h.runs() != 2 {
		t.Fatalf("runs = %d: a republish has a new messageId and is a new delivery to the default key", h.runs())
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
			"Ce-Type": idempotency.PubSubEventType, "Ce-Specversion": "1.0", "Ce-Source": "//pubsub.googleapis.com/projects/p/topics/t"}, 400, 0},
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

func TestIdempotentCustomKeyOverride(t *testing.T) {
	s, _ := newStore(t)
	runs := 0
	h := idempotency.Idempotent(s, idempotency.WithKey(func(e cloudevents.Event) (string, error) {
		return "custom:" + e.Subject(), nil
	}))(func(context.Context, cloudevents.Event) error { runs++; return nil })
	for _, id := range []string{"m-1", "m-2"} {
		e := pubsubEvent(t, id, map[string]any{"messageId": id})
		e.SetSubject("PO-1")
		if err := h(t.Context(), e); err != nil {
			t.Fatal(err)
		}
	}
	if _, ok := s.Record("custom:PO-1"); !ok || runs != 1 {
		t.Fatalf("runs = %d, record present = %v; want one run under the custom key", runs, ok)
	}
}

func TestIdempotentKeyFuncErrorNacksWithoutRunning(t *testing.T) {
	s, _ := newStore(t)
	boom := errors.New("lookup failed")
	h := idempotency.Idempotent(s, idempotency.AllowUnguarded(), idempotency.WithKey(func(cloudevents.Event) (string, error) {
		return "", boom
	}))(func(context.Context, cloudevents.Event) error { t.Error("handler ran"); return nil })
	if err := h(t.Context(), pubsubEvent(t, "1", map[string]any{})); !errors.Is(err, boom) {
		t.Fatalf("err = %v, want the key func's error", err)
	}
}

func TestIdempotentOnDuplicateHookNeverChangesTheAck(t *testing.T) {
	for name, hook := range map[string]func(context.Context, string) error{
		"returns an error": func(context.Context, string) error { return errors.New("metrics down") },
		"panics":           func(context.Context, string) error { panic("hook bug") },
		"succeeds":         func(context.Context, string) error { return nil },
	} {
		t.Run(name, func(t *testing.T) {
			s, _ := newStore(t)
			l, logger := newLogs()
			var seen []string
			h := idempotency.Idempotent(s, idempotency.WithLogger(logger),
				idempotency.OnDuplicate(func(ctx context.Context, key string) error {
					seen = append(seen, key)
					return hook(ctx, key)
				}))(func(context.Context, cloudevents.Event) error { return nil })
			e := pubsubEvent(t, "m-1", map[string]any{"messageId": "m-1"})
			if err := h(t.Context(), e); err != nil {
				t.Fatal(err)
			}
			if err := h(t.Context(), e); err != nil {
				t.Fatalf("duplicate with a hook that %s: %v, want nil (ack)", name, err)
			}
			if len(seen) != 1 || seen[0] != "m-1" {
				t.Fatalf("hook saw %v, want [m-1]", seen)
			}
			wantErrLogs := 1
			if name == "succeeds" {
				wantErrLogs = 0
			}
			if got := len(l.find(t, "ERROR", "on-duplicate hook")); got != wantErrLogs {
				t.Fatalf("%d hook error logs, want %d: %v", got, wantErrLogs, l.records(t))
			}
		})
	}
}

func TestIdempotentDisableSwitch(t *testing.T) {
	for _, v := range []string{"1", "true", "TRUE", "Yes", " on "} {
		t.Run(v, func(t *testing.T) {
			t.Setenv(idempotency.DisableEnv, v)
			l, logger := newLogs()
			runs := 0
			h := idempotency.Idempotent(untouchable(t), idempotency.WithLogger(logger))(
				func(context.Context, cloudevents.Event) error { runs++; return nil })
			e := pubsubEvent(t, "m-1", map[string]any{"messageId": "m-1"})
			h(t.Context(), e)
			h(t.Context(), e)
			if runs != 2 {
				t.Fatalf("runs = %d, want 2 (unguarded pass-through)", runs)
			}
			if got := len(l.find(t, "WARN", idempotency.DisableEnv)); got != 1 {
				t.Fatalf("%d warnings, want exactly one", got)
			}
		})
	}
	for _, v := range []string{"", "0", "false", "off", "disabled"} {
		t.Setenv(idempotency.DisableEnv, v)
		if idempotency.Disabled() {
			t.Errorf("Disabled() with %q = true", v)
		}
	}
	// Disabled, a nil backend is fine: nothing is ever built or called.
	t.Setenv(idempotency.DisableEnv, "1")
	idempotency.Idempotent(nil, idempotency.WithLogger(newDiscard()))
}

func TestIdempotentPanicsOnProgrammingMistakes(t *testing.T) {
	s, _ := newStore(t)
	cases := map[string]func(){
		"nil backend":     func() { idempotency.Idempotent(nil) },
		"zero lease":      func() { idempotency.Idempotent(s, idempotency.WithLease(0)) },
		"nil key func":    func() { idempotency.Idempotent(s, idempotency.WithKey(nil)) },
		"NUL in prefix":   func() { idempotency.Idempotent(s, idempotency.WithKeyPrefix("a\x00")) },
		"nil handler":     func() { idempotency.Idempotent(s)(nil) },
		"negative settle": func() { idempotency.Idempotent(s, idempotency.WithSettleTimeout(-1)) },
	}
	for name, f := range cases {
		t.Run(name, func(t *testing.T) {
			defer func() {
				msg, _ := recover().(string)
				if !strings.HasPrefix(msg, "idempotency.Idempotent: ") {
					t.Fatalf("panic %q, want a message naming Idempotent", msg)
				}
			}()
			f()
		})
	}
}

// A key the port refuses (NUL byte, or pushed past MaxKeyLen by the
// prefix) is an error before the backend is called; a key of exactly
// MaxKeyLen bytes, or one that is not UTF-8, is a key like any other.
func TestKeysThePortRefusesNeverReachTheBackend(t *testing.T) {
	long := strings.Repeat("k", 1024)
	for name, key := range map[string]string{"NUL": "a\x00b", "over MaxKeyLen with the prefix": long[:1020]} {
		t.Run(name, func(t *testing.T) {
			h := idempotency.Idempotent(untouchable(t), idempotency.WithKeyPrefix("orders:"),
				idempotency.WithKey(func(cloudevents.Event) (string, error) { return key, nil }))(
				func(context.Context, cloudevents.Event) error { t.Error("handler ran"); return nil })
			err := h(t.Context(), pubsubEvent(t, "m", map[string]any{"messageId": "m"}))
			var res *cehttp.Result
			if !errors.Is(err, store.ErrInvalidKey) || !errors.As(err, &res) || res.StatusCode != http.StatusBadRequest {
				t.Fatalf("err %v: want a 400 result wrapping store.ErrInvalidKey", err)
			}
		})
	}
	for name, key := range map[string]string{"1 KiB": long, "not UTF-8": "\xff\xfe\x80"} {
		t.Run(name, func(t *testing.T) {
			s, _ := newStore(t)
			runs := 0
			h := idempotency.Idempotent(s, idempotency.WithKey(func(cloudevents.Event) (string, error) { return key, nil }))(
				func(context.Context, cloudevents.Event) error { runs++; return nil })
			e := pubsubEvent(t, "m", map[string]any{"messageId": "m"})
			if err := h(t.Context(), e); err != nil {
				t.Fatal(err)
			}
			if err := h(t.Context(), e); err != nil || runs != 1 {
				t.Fatalf("redelivery: %v, runs %d; want an ack and one run", err, runs)
			}
			if _, ok := s.Record(key); !ok {
				t.Fatal("no record under the exact key")
			}
		})
	}
}

// lostExtender is a store whose every lease renewal finds the claim lost.
type lostExtender struct{ *fake.Store }

func (lostExtender) Extend(_ context.Context, c store.Claim, _ time.Duration) (store.Claim, error) {
	return c, fmt.Errorf("renewing %q: %w", c.Key, store.ErrLost)
}

// No error this package returns, and no response body PushHandler writes,
// says "idempotency:" twice: every error path, driven once.
func TestNoErrorSaysIdempotencyTwice(t *testing.T) {
	var errs []error
	collect := func(name string, err error) {
		t.Helper()
		if err == nil {
			t.Errorf("%s: no error", name)
			return
		}
		errs = append(errs, fmt.Errorf("%s: %w", name, err))
	}
	ctx := t.Context()
	noop := func(context.Context) error { return nil }
	okHandler := func(context.Context, cloudevents.Event) error { return nil }
	ev := func(data string) cloudevents.Event {
		e := cloudevents.NewEvent()
		e.SetID("e-1")
		e.SetSource("//pubsub.googleapis.com/projects/p/topics/t")
		e.SetType(idempotency.PubSubEventType)
		e.DataEncoded = []byte(data)
		e.SetDataContentType(cloudevents.ApplicationJSON)
		return e
	}
	hostile := map[string]cloudevents.Event{
		"not JSON":             ev(`<xml/>`),
		"no message":           ev(`{"subscription":"s"}`),
		"NUL messageId":        ev(`{"message":{"messageId":"a\u0000b"}}`),
		"NUL attribute":        ev(`{"message":{"messageId":"m","attributes":{"k":"a\u0000b"}}}`),
		"payload not JSON":     ev(`{"message":{"messageId":"m","data":"PHhtbC8+"}}`),
		"NUL field":            ev(`{"message":{"messageId":"m","data":"` + payload(map[string]any{"id": "a\x00b"}) + `"}}`),
		"field not a scalar":   ev(`{"message":{"messageId":"m","data":"` + payload(map[string]any{"id": []int{1}}) + `"}}`),
		"unkeyed (other type)": func() cloudevents.Event { e := ev(`{"message":{}}`); e.SetType("com.example.v1"); return e }(),
	}
	keyFuncs := map[string]idempotency.KeyFunc{
		"MessageID":  idempotency.MessageID(),
		"Attribute":  idempotency.Attribute("k"),
		"JSONField":  idempotency.JSONField("id"),
		"custom":     func(cloudevents.Event) (string, error) { return "", errors.New("lookup failed") },
		"custom NUL": func(cloudevents.Event) (string, error) { return "a\x00b", nil },
		"custom long": func(cloudevents.Event) (string, error) {
			return strings.Repeat("k", store.MaxKeyLen), nil // pushed past MaxKeyLen by the prefix
		},
	}
	for en, e := range hostile {
		if _, err := idempotency.ParsePubSub(e); err != nil {
			collect("ParsePubSub/"+en, err)
		}
		for kn, kf := range keyFuncs {
			if _, err := kf(e); err != nil {
				collect(kn+"/"+en, err)
			}
			s, _ := newStore(t)
			err := idempotency.Idempotent(s, idempotency.WithKey(kf), idempotency.WithKeyPrefix("orders:"),
				idempotency.WithLogger(newDiscard()))(okHandler)(ctx, e)
			if err != nil {
				collect("Idempotent/"+kn+"/"+en, err)
				var res *cehttp.Result
				if errors.As(err, &res) {
					collect("Idempotent/"+kn+"/"+en+" as a result", res)
				}
			}
		}
	}

	good := pubsubEvent(t, "m-1", map[string]any{"messageId": "m-1"})
	guarded := func(s store.Backend, h idempotency.CloudEventFunc) error {
		return idempotency.Idempotent(s, idempotency.WithLogger(newDiscard()))(h)(ctx, good)
	}
	s, _ := newStore(t)
	s.FailNext(fake.OpClaim, errors.New("connection refused"))
	collect("Idempotent/claim error", guarded(s, okHandler))
	s, _ = newStore(t)
	s.Claim(ctx, "m-1", time.Hour)
	collect("Idempotent/in progress", guarded(s, okHandler))
	s, _ = newStore(t)
	completeSubKey(t, s, "po:PO-1")
	ran := 0
	collect("Idempotent/nested duplicate", guarded(s, nestedDuplicate(s, &ran)))
	s, _ = newStore(t)
	collect("Idempotent/nil handler error", guarded(s, func(context.Context, cloudevents.Event) error {
		return (*idempotency.DuplicateError)(nil)
	}))
	s, _ = newStore(t)
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	collect("Idempotent/cancelled", idempotency.Idempotent(s)(okHandler)(cctx, good))

	s, _ = newStore(t)
	collect("Lock/nil backend", idempotency.Lock(ctx, nil, "k", noop))
	collect("Lock/nil body", idempotency.Lock(ctx, s, "k", nil))
	collect("Lock/empty key", idempotency.Lock(ctx, s, "", noop))
	collect("Lock/zero lease", idempotency.Lock(ctx, s, "k", noop, idempotency.WithLease(0)))
	collect("Lock/negative settle", idempotency.Lock(ctx, s, "k", noop, idempotency.WithSettleTimeout(-1)))
	collect("Lock/long heartbeat", idempotency.Lock(ctx, s, "k", noop, idempotency.WithHeartbeat(time.Hour)))
	collect("Lock/negative margin", idempotency.Lock(ctx, s, "k", noop, idempotency.WithLeaseFromDeadline(-time.Second)))
	collect("Idempotent/hashed key behind a long prefix", idempotency.Idempotent(s, idempotency.WithHashedKeys(),
		idempotency.WithKeyPrefix(strings.Repeat("p", 1000)+":"), idempotency.WithKey(keyFuncs["custom long"]))(okHandler)(ctx, good))
	func() {
		t.Setenv(idempotency.DisableEnv, "1")
		h := idempotency.Idempotent(nil, idempotency.WithLogger(newDiscard()))(okHandler)
		t.Setenv(idempotency.DisableEnv, "")
		collect("Idempotent/nil backend, switch unset", h(ctx, good))
	}()
	completeSubKey(t, s, "done")
	collect("Lock/duplicate", idempotency.Lock(ctx, s, "done", noop))
	collect("Mutex/done", idempotency.Mutex(ctx, s, "done", noop))
	s.Claim(ctx, "held", time.Hour)
	collect("Lock/in progress", idempotency.Lock(ctx, s, "held", noop))
	var cause error
	idempotency.Lock(ctx, lostExtender{fake.New()}, "lost", func(ctx context.Context) error {
		<-ctx.Done()
		cause = context.Cause(ctx)
		return nil
	}, idempotency.WithHeartbeat(idempotency.MinHeartbeat), idempotency.WithLogger(newDiscard()))
	collect("Lock/heartbeat cause", cause)

	// PushHandler writes the error as the response body.
	for name, body := range map[string]string{
		"not JSON":      `<xml/>`,
		"no message":    `{"subscription":"s"}`,
		"no message id": `{"message":{"data":"e30="}}`,
		"NUL":           `{"message":{"messageId":"a\u0000b"}}`,
	} {
		s, _ := newStore(t)
		r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(body))
		w := httptest.NewRecorder()
		idempotency.PushHandler(s, okHandler, idempotency.WithLogger(newDiscard())).ServeHTTP(w, r)
		collect("PushHandler/"+name, errors.New(w.Body.String()))
	}

	for _, err := range errs {
		if n := strings.Count(err.Error(), "idempotency:"); n > 1 {
			t.Errorf("%q says idempotency: %d times", err, n)
		}
	}
	if len(errs) < 60 {
		t.Fatalf("only %d error paths driven", len(errs))
	}
}

// A KeyFunc's error of any shape nacks without running the handler or
// touching the backend, with the same status through the framework and
// PushHandler: 400 when it wraps a "message at fault" sentinel (even under
// a result whose status would ack), the 4xx/5xx its own result carries,
// else 500. Neither an ack status, an ACK receipt, a typed nil, nor a
// Lock's own duplicate passed off as the KeyFunc's error acks.
func TestKeyFuncErrorsOfEveryShapeNackOnBothPaths(t *testing.T) {
	done := fake.New()
	completeSubKey(t, done, "k")
	ownDuplicate := idempotency.Lock(t.Context(), done, "k", func(context.Context) error { return nil })
	for _, c := range []struct {
		name string
		err  error
		want int
	}{
		{"plain", errors.New("lookup failed"), 500},
		{"says idempotency:", errors.New("idempotency: lookup failed"), 500},
		{"wraps ErrNoKey", fmt.Errorf("x: %w", idempotency.ErrNoKey), 400},
		{"202 result", cehttp.NewResult(202, "accepted"), 500},
		{"202 result that says idempotency:", cehttp.NewResult(202, "idempotency: accepted"), 500},
		{"202 result wrapping store.ErrInvalidKey", cehttp.NewResult(202, "%w", store.ErrInvalidKey), 400},
		{"ACK receipt", protocol.ResultACK, 500},
		{"nil result", (*cehttp.Result)(nil), 500},
		{"nil in-progress error", (*idempotency.InProgressError)(nil), 500},
		{"nil duplicate error", (*idempotency.DuplicateError)(nil), 500},
		{"a Lock's own duplicate", ownDuplicate, 500},
		{"in progress", &idempotency.InProgressError{Key: "k"}, 500},
		{"429 result", cehttp.NewResult(429, "slow down"), 429},
	} {
		t.Run(c.name, func(t *testing.T) {
			opts := []idempotency.Option{idempotency.WithLogger(newDiscard()),
				idempotency.WithKey(func(cloudevents.Event) (string, error) { return "", c.err })}
			h := func(context.Context, cloudevents.Event) error { t.Error("handler ran"); return nil }
			serve(t, idempotency.Idempotent(untouchable(t), opts...)(h))
			ff, body := post(t, "eventarc_binary")
			srv := httptest.NewServer(idempotency.PushHandler(untouchable(t), h, opts...))
			defer srv.Close()
			if push := pushTo(t, srv.URL, "eventarc_binary"); ff != c.want || push != c.want {
				t.Fatalf("framework HTTP %d %q, PushHandler %d; want %d", ff, body, push, c.want)
			}
		})
	}
}

// Through the real functions framework, CLOUD_RUN_TIMEOUT_SECONDS=30 puts
// a 30s deadline on the request, and WithLeaseFromDeadline(5s) claims for
// 30s + the 10s settle timeout + 5s, less the moments the request took to
// arrive; PushHandler gets the same under http.TimeoutHandler. Without a
// deadline both claim for WithLease's lease.
func TestHTTPLeaseFromTheFunctionTimeout(t *testing.T) {
	const want = 45 * time.Second
	inWindow := func(lease time.Duration) bool { return lease > want-5*time.Second && lease <= want }
	for _, timeout := range []string{"30", ""} {
		t.Run("CLOUD_RUN_TIMEOUT_SECONDS="+timeout, func(t *testing.T) {
			t.Setenv("CLOUD_RUN_TIMEOUT_SECONDS", timeout)
			s, _ := newStore(t)
			rec := &leaseRecorder{Store: s}
			opts := []idempotency.Option{idempotency.WithLeaseFromDeadline(5 * time.Second), idempotency.WithLease(20 * time.Minute),
				idempotency.WithLogger(newDiscard())}
			c := &counting{}
			serve(t, idempotency.Idempotent(rec, opts...)(c.handle))
			if code, body := post(t, "eventarc_binary"); code != http.StatusOK {
				t.Fatalf("HTTP %d %q", code, body)
			}
			if got := rec.last(t); (timeout != "" && !inWindow(got)) || (timeout == "" && got != 20*time.Minute) {
				t.Fatalf("framework: lease %v", got)
			}
			var h http.Handler = idempotency.PushHandler(rec, c.handle, opts...)
			if timeout != "" {
				h = http.TimeoutHandler(h, 30*time.Second, "timed out")
			}
			srv := httptest.NewServer(h)
			defer srv.Close()
			if code := pushTo(t, srv.URL, "push_raw"); code != http.StatusNoContent {
				t.Fatalf("PushHandler: HTTP %d", code)
			}
			if got := rec.last(t); (timeout != "" && !inWindow(got)) || (timeout == "" && got != 20*time.Minute) {
				t.Fatalf("PushHandler: lease %v", got)
			}
		})
	}
}

// The disable switch is read on every delivery: flipped between the
// deliveries of one wrapped handler, through the framework and
// PushHandler, it takes effect at once, and each time it turns on it
// warns once.
func TestDisableSwitchIsReadPerDelivery(t *testing.T) {
	for _, path := range []string{"framework", "PushHandler"} {
		t.Run(path, func(t *testing.T) {
			t.Setenv(idempotency.DisableEnv, "")
			s, _ := newStore(t)
			l, logger := newLogs()
			c := &counting{}
			deliver := func() int { code, _ := post(t, "eventarc_binary"); return code }
			ack := http.StatusOK
			if path == "framework" {
				serve(t, idempotency.Idempotent(s, idempotency.WithLogger(logger))(c.handle))
			} else {
				srv := httptest.NewServer(idempotency.PushHandler(s, c.handle, idempotency.WithLogger(logger)))
				defer srv.Close()
				deliver = func() int { return pushTo(t, srv.URL, "eventarc_binary") }
				ack = http.StatusNoContent
			}
			for i, step := range []struct {
				env          string
				runs, claims int
				warnings     int
			}{
				{"", 1, 1, 0},     // guarded: runs, key done
				{"", 1, 2, 0},     // guarded: a duplicate
				{"1", 2, 2, 1},    // disabled: runs again, backend untouched, one warning
				{"true", 3, 2, 1}, // still disabled: no second warning
				{"0", 3, 3, 1},    // guarded again: a duplicate
				{"on", 4, 3, 2},   // disabled again: warns again
			} {
				t.Setenv(idempotency.DisableEnv, step.env)
				if code := deliver(); code != ack {
					t.Fatalf("delivery %d (%q): HTTP %d", i, step.env, code)
				}
				if c.runs() != step.runs || s.Calls(fake.OpClaim) != step.claims || len(l.find(t, "WARN", idempotency.DisableEnv)) != step.warnings {
					t.Fatalf("delivery %d (%q): runs %d, claims %d, warnings %d; want %d, %d, %d", i, step.env,
						c.runs(), s.Calls(fake.OpClaim), len(l.find(t, "WARN", idempotency.DisableEnv)), step.runs, step.claims, step.warnings)
				}
			}
		})
	}
}

// Wrapped with a nil backend while the switch was set, a delivery that
// finds it unset is refused (500, nack) without running the handler.
func TestDisableSwitchUnsetAfterANilBackendNacks(t *testing.T) {
	t.Setenv(idempotency.DisableEnv, "1")
	c := &counting{}
	opts := []idempotency.Option{idempotency.WithLogger(newDiscard())}
	serve(t, idempotency.Idempotent(nil, opts...)(c.handle))
	srv := httptest.NewServer(idempotency.PushHandler(nil, c.handle, opts...))
	defer srv.Close()
	t.Setenv(idempotency.DisableEnv, "")
	if code, _ := post(t, "eventarc_binary"); code != http.StatusInternalServerError || !strings.Contains(fmt.Sprint(returned()), "nil backend") {
		t.Fatalf("framework: HTTP %d (%v), want 500 naming the nil backend", code, returned())
	}
	if code := pushTo(t, srv.URL, "eventarc_binary"); code != http.StatusInternalServerError || c.runs() != 0 {
		t.Fatalf("PushHandler: HTTP %d, runs %d; want 500 and no run", code, c.runs())
	}
}

// BenchmarkIdempotentDirect calls a wrapped handler directly (no HTTP) on
// the fake store: a duplicate (one Claim) and a fresh key (Claim and
// Complete). It measures the wrapper's own per-delivery cost, such as
// reading the disable switch.
func BenchmarkIdempotentDirect(b *testing.B) {
	for _, fresh := range []bool{false, true} {
		b.Run(fmt.Sprint("fresh=", fresh), func(b *testing.B) {
			h := idempotency.Idempotent(fake.New(), idempotency.WithLogger(quiet))(noop)
			events := make([]cloudevents.Event, 1024)
			for i := range events {
				id := fmt.Sprint(i)
				events[i] = cloudevents.NewEvent()
				events[i].SetID(id)
				events[i].SetSource("//pubsub.googleapis.com/projects/p/topics/t")
				events[i].SetType(idempotency.PubSubEventType)
				events[i].SetData(cloudevents.ApplicationJSON, map[string]any{"message": map[string]any{"messageId": id}})
			}
			h(b.Context(), events[0])
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				e := events[0]
				if fresh {
					i++
					e.SetID(fmt.Sprint("f", i))
				}
				if err := h(b.Context(), e); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkDisableSwitchRead is what reading the disable switch costs on
// every delivery.
func BenchmarkDisableSwitchRead(b *testing.B) {
	for b.Loop() {
		if idempotency.Disabled() {
			b.Fatal("disabled")
		}
	}
}
