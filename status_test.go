package idempotency_test

import (
	"context"
	"errors"
	"fmt"
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

// Defect 3: a body error that wraps ErrDuplicate is not the wrapper's own
// duplicate. The outer claim was released, so acking would lose the message.
func TestIdempotentBodyErrorWrappingErrDuplicateNacks(t *testing.T) {
	s, _ := newStore(t)
	completeSubKey(t, s, "po:PO-1")
	l, logger := newLogs()
	var dups []string
	ran := 0
	h := idempotency.Idempotent(s, idempotency.WithLogger(logger),
		idempotency.OnDuplicate(func(_ context.Context, key string) error { dups = append(dups, key); return nil }),
	)(nestedDuplicate(s, &ran))
	e := pubsubEvent(t, "m-1", map[string]any{"messageId": "m-1"})
	err := h(t.Context(), e)
	if err == nil {
		t.Fatal("the body failed with a nested duplicate, and Idempotent returned nil (ack): the message is lost")
	}
	if !errors.Is(err, idempotency.ErrDuplicate) || !strings.Contains(err.Error(), "reserving stock") {
		t.Fatalf("err = %v, want the body's own error, unchanged", err)
	}
	if len(dups) != 0 {
		t.Fatalf("OnDuplicate called with %v for a delivery whose handler ran", dups)
	}
	if got := l.find(t, "INFO", "handler not run"); len(got) != 0 {
		t.Fatalf("logged %v although the handler ran", got)
	}
	assertReleased(t, s, "m-1")
	// The redelivery runs the handler again: nothing is lost.
	h(t.Context(), e)
	if ran != 2 {
		t.Fatalf("handler ran %d times, want 2 (the failure and its retry)", ran)
	}
	// The wrapper's OWN duplicate still acks, once the message key is done.
	ok := idempotency.Idempotent(s, idempotency.WithLogger(logger),
		idempotency.OnDuplicate(func(_ context.Context, key string) error { dups = append(dups, key); return nil }),
	)(func(context.Context, cloudevents.Event) error { return nil })
	if err := ok(t.Context(), e); err != nil {
		t.Fatal(err)
	}
	if err := ok(t.Context(), e); err != nil || len(dups) != 1 || dups[0] != "m-1" {
		t.Fatalf("own duplicate: err %v, hook saw %v; want nil and [m-1]", err, dups)
	}
}

// A body error wrapping ErrInProgress (an inner Mutex or Lock found its key
// held) still nacks; it becomes a 503 so the retry waits, and the warning
// names the inner key, not the message key.
func TestIdempotentBodyErrorWrappingErrInProgressIsA503Nack(t *testing.T) {
	s, _ := newStore(t)
	if _, err := s.Claim(t.Context(), "po:PO-1", time.Hour); err != nil {
		t.Fatal(err)
	}
	l, logger := newLogs()
	h := idempotency.Idempotent(s, idempotency.WithLogger(logger))(func(ctx context.Context, e cloudevents.Event) error {
		err := idempotency.Lock(ctx, s, "po:PO-1", func(context.Context) error { return nil })
		return fmt.Errorf("reserving stock: %w", err)
	})
	err := h(t.Context(), pubsubEvent(t, "m-1", map[string]any{"messageId": "m-1"}))
	var res *cehttp.Result
	if !errors.As(err, &res) || res.StatusCode != http.StatusServiceUnavailable || !errors.Is(err, idempotency.ErrInProgress) ||
		!strings.Contains(err.Error(), "reserving stock") {
		t.Fatalf("err = %v, want a 503 result wrapping the body's error", err)
	}
	assertReleased(t, s, "m-1")
	w := l.find(t, "WARN", "")
	if len(w) != 1 || w[0]["key"] != "po:PO-1" || w[0]["message_key"] != "m-1" {
		t.Fatalf("warnings %v, want one naming the inner key po:PO-1 and the message key m-1", w)
	}
}

func TestHTTPBodyErrorWrappingErrDuplicateIsNotAcked(t *testing.T) {
	s, _ := newStore(t)
	completeSubKey(t, s, "po:PO-1")
	ran := 0
	serve(t, idempotency.Idempotent(s, idempotency.WithLogger(newDiscard()))(nestedDuplicate(s, &ran)))
	if code, body := post(t, "eventarc_binary"); code != http.StatusInternalServerError {
		t.Fatalf("HTTP %d %s, want 500 (nack): the handler ran and failed", code, body)
	}
	assertReleased(t, s, fixtureID)
}

// failure is one error a failing handler may return, and the status a
// nack must carry for it on the wire.
type failure struct {
	name string
	err  error
	want int
}

func failures() []failure {
	var out []failure
	for _, s := range []int{0, 1, 100, 101, 102, 103, 200, 201, 202, 204, 206, 301, 302, 304, 399, 600, 999, -1} {
		out = append(out, failure{fmt.Sprintf("result %d", s), cehttp.NewResult(s, "handler failed"), http.StatusInternalServerError})
	}
	for _, s := range []int{400, 404, 409, 429, 500, 502, 503, 599} {
		out = append(out, failure{fmt.Sprintf("result %d", s), cehttp.NewResult(s, "handler failed"), s})
	}
	return append(out,
		failure{"wrapped result 202", fmt.Errorf("charging: %w", cehttp.NewResult(202, "accepted")), http.StatusInternalServerError},
		failure{"ACK receipt", protocol.ResultACK, http.StatusInternalServerError},
		failure{"wrapped ACK receipt", fmt.Errorf("x: %w", protocol.NewReceipt(true, "fine")), http.StatusInternalServerError},
		failure{"nil result", (*cehttp.Result)(nil), http.StatusInternalServerError},
		failure{"plain error", errors.New("boom"), http.StatusInternalServerError},
		// Typed nils: a non-nil error holding a nil pointer is still a failure,
		// and must neither crash the wrapper nor ack.
		failure{"nil in-progress error", (*idempotency.InProgressError)(nil), http.StatusServiceUnavailable},
		failure{"wrapped nil in-progress error", fmt.Errorf("inner: %w", (*idempotency.InProgressError)(nil)), http.StatusServiceUnavailable},
		failure{"nil duplicate error", (*idempotency.DuplicateError)(nil), http.StatusInternalServerError},
	)
}

// Defect 4: whatever status a failing handler's result carries, PushHandler
// answers a nack (4xx/5xx), and the claim is released so the redelivery runs.
func TestPushHandlerNeverAcksAFailingHandlersStatus(t *testing.T) {
	for _, f := range failures() {
		t.Run(f.name, func(t *testing.T) {
			s, _ := newStore(t)
			srv := httptest.NewServer(idempotency.PushHandler(s,
				func(context.Context, cloudevents.Event) error { return f.err }, idempotency.WithLogger(newDiscard())))
			defer srv.Close()
			code := pushTo(t, srv.URL, "push_raw")
			if code != f.want || pubsubAcks[code] {
				t.Fatalf("HTTP %d, want %d (a nack)", code, f.want)
			}
			assertReleased(t, s, fixtureID)
		})
	}
}

// The same through the real functions framework: Idempotent's return value
// never makes the framework write an ack for a failed handler.
func TestHTTPFailingHandlersStatusNeverAcks(t *testing.T) {
	for _, f := range failures() {
		t.Run(f.name, func(t *testing.T) {
			s, _ := newStore(t)
			serve(t, idempotency.Idempotent(s, idempotency.WithLogger(newDiscard()))(
				func(context.Context, cloudevents.Event) error { return f.err }))
			code, body := post(t, "eventarc_binary")
			if code != f.want || pubsubAcks[code] {
				t.Fatalf("HTTP %d %q, want %d (a nack)", code, body, f.want)
			}
			if f.name != "nil result" && !errors.Is(returned(), f.err) {
				t.Fatalf("returned %v, which hides the handler's error %v", returned(), f.err)
			}
			assertReleased(t, s, fixtureID)
		})
	}
}

// What the functions framework itself (v1.9.2 over cloudevents sdk-go
// v2.16.2) writes for an UNGUARDED function's error: measured here so that
// a framework upgrade that changes it is noticed. This is why Idempotent
// rewrites a failure whose status would ack.
func TestFrameworkWritesTheStatusOfAFunctionsResult(t *testing.T) {
	cases := []struct {
		name string
		err  error
		want int
	}{
		{"result 202 acks", cehttp.NewResult(202, "x"), 202},
		{"result 204 acks", cehttp.NewResult(204, "x"), 204},
		{"result 102 ends as 200", cehttp.NewResult(102, "x"), 200},
		{"result 302 is written", cehttp.NewResult(302, "x"), 302},
		{"result 0 is 200", cehttp.NewResult(0, "x"), 200},
		{"result 600 is 200", cehttp.NewResult(600, "x"), 200},
		{"ACK receipt is 200", protocol.ResultACK, 200},
		{"plain error is 500", errors.New("x"), 500},
		{"result 503", cehttp.NewResult(503, "x"), 503},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			serve(t, func(context.Context, cloudevents.Event) error { return c.err })
			if code, body := post(t, "eventarc_binary"); code != c.want {
				t.Fatalf("HTTP %d %q, measured %d before", code, body, c.want)
			}
		})
	}
}

// A handler's error that wraps ErrInProgress is still a nack (503) even if
// it also carries an ack status.
func TestPushHandlerInnerContentionWithAnAckStatusStillNacks(t *testing.T) {
	s, _ := newStore(t)
	err := cehttp.NewResult(202, "%w", &idempotency.InProgressError{Key: "po:PO-1"})
	srv := httptest.NewServer(idempotency.PushHandler(s,
		func(context.Context, cloudevents.Event) error { return err }, idempotency.WithLogger(newDiscard())))
	defer srv.Close()
	if code := pushTo(t, srv.URL, "push_raw"); code != http.StatusServiceUnavailable {
		t.Fatalf("HTTP %d, want 503", code)
	}
	if !strings.Contains(err.Error(), "po:PO-1") {
		t.Fatal(err)
	}
}

// The disable switch turns off duplicate suppression, not the failure
// mapping: a failing handler still nacks through the real framework.
func TestHTTPDisabledFailingHandlerStillNacks(t *testing.T) {
	t.Setenv(idempotency.DisableEnv, "1")
	for _, f := range failures() {
		t.Run(f.name, func(t *testing.T) {
			serve(t, idempotency.Idempotent(nil, idempotency.WithLogger(newDiscard()))(
				func(context.Context, cloudevents.Event) error { return f.err }))
			code, body := post(t, "eventarc_binary")
			if pubsubAcks[code] || code < 400 || code > 599 {
				t.Fatalf("HTTP %d %q: a failing handler was acked with the guard disabled", code, body)
			}
		})
	}
}

func TestIdempotentInnerMutexContentionIsA503(t *testing.T) {
	s, _ := newStore(t)
	s.Claim(t.Context(), "po:PO-1", time.Hour) // another update holds the entity
	h := idempotency.Idempotent(s)(func(ctx context.Context, e cloudevents.Event) error {
		return idempotency.Mutex(ctx, s, "po:PO-1", func(context.Context) error { return nil })
	})
	err := h(t.Context(), pubsubEvent(t, "m-1", map[string]any{"messageId": "m-1"}))
	var res *cehttp.Result
	if !errors.As(err, &res) || res.StatusCode != http.StatusServiceUnavailable || !errors.Is(err, idempotency.ErrInProgress) {
		t.Fatalf("err = %v, want a 503 result wrapping ErrInProgress", err)
	}
	// The message key was released, not completed: the retry runs.
	if rec, _ := s.Record("m-1"); rec.State != store.Claimed || rec.Fence != 2 {
		t.Fatalf("message record %+v, want released", rec)
	}
}

// One mapping from outcome to status: the same request, served by
// Idempotent through the real functions framework and by PushHandler,
// gets the same status for every outcome, except that PushHandler writes
// its ack as a 204 where the framework writes a 200 (both acks).
func TestFrameworkAndPushHandlerAnswerTheSameStatus(t *testing.T) {
	ok := func(context.Context, cloudevents.Event) error { return nil }
	fail := func(err error) idempotency.CloudEventFunc {
		return func(context.Context, cloudevents.Event) error { return err }
	}
	cases := []struct {
		name     string
		fixture  string
		setup    func(t *testing.T, s *fake.Store)
		disabled bool
		handler  idempotency.CloudEventFunc
		want     int // through the framework; PushHandler answers 204 for a 200
		runs     int
		is       error // what the returned error must wrap, if anything
		opts     []idempotency.Option
	}{
		{name: "won, handler ok", fixture: "eventarc_binary", handler: ok, want: 200, runs: 1},
		{name: "won, handler ok, raw push", fixture: "push_raw", handler: ok, want: 200, runs: 1},
		{name: "duplicate", fixture: "eventarc_binary", handler: ok, want: 200,
			setup: func(t *testing.T, s *fake.Store) { completeSubKey(t, s, fixtureID) }},
		{name: "in progress", fixture: "eventarc_binary", handler: ok, want: 503, is: idempotency.ErrInProgress,
			setup: func(t *testing.T, s *fake.Store) { s.Claim(t.Context(), fixtureID, time.Hour) }},
		{name: "handler error", fixture: "eventarc_binary", handler: fail(errors.New("boom")), want: 500, runs: 1},
		{name: "handler error with its own 4xx", fixture: "eventarc_binary", handler: fail(cehttp.NewResult(429, "slow down")), want: 429, runs: 1},
		{name: "handler error with its own 5xx", fixture: "eventarc_binary", handler: fail(cehttp.NewResult(502, "bad gateway")), want: 502, runs: 1},
		{name: "handler error with an ack status", fixture: "eventarc_binary", handler: fail(cehttp.NewResult(202, "accepted")), want: 500, runs: 1},
		{name: "handler error wrapping ErrInProgress", fixture: "eventarc_binary", want: 503, runs: 1, is: idempotency.ErrInProgress,
			handler: fail(fmt.Errorf("inner: %w", &idempotency.InProgressError{Key: "po:PO-1"}))},
		{name: "no key", fixture: "unkeyed", handler: ok, want: 400, is: idempotency.ErrNoKey, opts: byPO},
		{name: "won, handler ok, an Eventarc event of Cloud Storage", fixture: "eventarc_storage", handler: ok, want: 200, runs: 1},
		{name: "duplicate of an Eventarc event of Cloud Storage", fixture: "eventarc_storage", handler: ok, want: 200,
			setup: func(t *testing.T, s *fake.Store) { completeSubKey(t, s, storageEventKey) }},
		{name: "malformed", fixture: "malformed", handler: ok, want: 400, is: idempotency.ErrMalformedEvent},
		{name: "backend error", fixture: "eventarc_binary", handler: ok, want: 500,
			setup: func(t *testing.T, s *fake.Store) { s.FailNext(fake.OpClaim, errors.New("connection refused")) }},
		{name: "disabled switch on, handler ok", fixture: "eventarc_binary", disabled: true, handler: ok, want: 200, runs: 1},
		{name: "disabled switch on, handler error", fixture: "eventarc_binary", disabled: true, handler: fail(errors.New("boom")), want: 500, runs: 1},
		{name: "disabled switch on, unkeyed", fixture: "unkeyed", disabled: true, handler: ok, want: 200, runs: 1, opts: byPO},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.disabled {
				t.Setenv(idempotency.DisableEnv, "1")
			}
			// Each path gets a fresh store in the same state.
			guard := func(t *testing.T) (*fake.Store, *counting, []idempotency.Option) {
				s, _ := newStore(t)
				if c.setup != nil {
					c.setup(t, s)
				}
				return s, &counting{}, append([]idempotency.Option{idempotency.WithLogger(newDiscard())}, c.opts...)
			}
			handler := func(h *counting) idempotency.CloudEventFunc {
				return func(ctx context.Context, e cloudevents.Event) error {
					h.handle(ctx, e)
					return c.handler(ctx, e)
				}
			}

			s, h, opts := guard(t)
			serve(t, idempotency.Idempotent(s, opts...)(handler(h)))
			ff, body := post(t, c.fixture)
			if ff != c.want || h.runs() != c.runs {
				t.Fatalf("framework: HTTP %d %q, runs %d; want %d and %d runs", ff, body, h.runs(), c.want, c.runs)
			}
			if c.is != nil && !errors.Is(returned(), c.is) {
				t.Fatalf("framework: Idempotent returned %v, which does not wrap %v", returned(), c.is)
			}

			s, h, opts = guard(t)
			srv := httptest.NewServer(idempotency.PushHandler(s, handler(h), opts...))
			defer srv.Close()
			push, body := postTo(t, srv.URL, c.fixture)
			if push != ff && !(ff == http.StatusOK && push == http.StatusNoContent) {
				t.Fatalf("PushHandler: HTTP %d %q, the framework %d", push, body, ff)
			}
			if h.runs() != c.runs {
				t.Fatalf("PushHandler: runs %d, want %d", h.runs(), c.runs)
			}
		})
	}
}

// The wire table's 503 for a handler's error wrapping ErrInProgress holds
// on every path on which the handler runs: also when it ran unguarded (an
// unkeyed event with AllowUnguarded, or the disable switch), through the
// framework and PushHandler alike, with one warning and no error log.
func TestHandlerErrorWrappingErrInProgressIsA503EvenUnguarded(t *testing.T) {
	inner := func(context.Context, cloudevents.Event) error {
		return fmt.Errorf("reserving: %w", &idempotency.InProgressError{Key: "po:PO-1"})
	}
	for _, c := range []struct {
		name     string
		disabled bool
		fixture  string
		opts     []idempotency.Option
	}{
		{name: "AllowUnguarded, unkeyed", fixture: "unkeyed", opts: append(byPO, idempotency.AllowUnguarded())},
		{name: "disable switch", disabled: true, fixture: "eventarc_binary"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.disabled {
				t.Setenv(idempotency.DisableEnv, "1")
			}
			s, _ := newStore(t)
			l, logger := newLogs()
			opts := append([]idempotency.Option{idempotency.WithLogger(logger)}, c.opts...)
			serve(t, idempotency.Idempotent(s, opts...)(inner))
			if code, body := post(t, c.fixture); code != http.StatusServiceUnavailable {
				t.Fatalf("framework: HTTP %d %q, want 503", code, body)
			}
			if !errors.Is(returned(), idempotency.ErrInProgress) {
				t.Fatalf("returned %v, which hides the handler's ErrInProgress", returned())
			}
			srv := httptest.NewServer(idempotency.PushHandler(s, inner, opts...))
			defer srv.Close()
			if code := pushTo(t, srv.URL, c.fixture); code != http.StatusServiceUnavailable {
				t.Fatalf("PushHandler: HTTP %d, want 503", code)
			}
			w := l.find(t, "WARN", "inner key in progress")
			if len(w) != 2 || w[0]["key"] != "po:PO-1" || w[0]["message_key"] != nil {
				t.Fatalf("warnings %v: want one per delivery naming the inner key and no message key", w)
			}
			if e := l.find(t, "ERROR", ""); len(e) != 0 {
				t.Fatalf("error logs %v for contention", e)
			}
		})
	}
}

// byPO keys by the po_id attribute, which the unkeyed fixture lacks.
var byPO = []idempotency.Option{idempotency.WithKey(idempotency.Attribute("po_id"))}

// storageEventKey is the default key of the eventarc_storage fixture: its
// source and id.
const storageEventKey = "//storage.googleapis.com/projects/_/buckets/invoices-inbox|7340129356201465"
