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
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The messageId of the fixtures in testdata/.
const fixtureID = "11223344556677"

// completeSubKey marks key done on s, as an earlier delivery's inner Lock
// would have.
func completeSubKey(t *testing.T, s store.Backend, key string) {
	t.Helper()
	if err := idempotency.Lock(t.Context(), s, key, func(context.Context) error { return nil }); err != nil {
		t.Fatal(err)
	}
}

// nestedDuplicate is a handler body that runs an inner Lock on a sub-key
// that is already done, and returns (wrapped) what the inner Lock said: the
// handler RAN, and failed.
func nestedDuplicate(s store.Backend, ran *int) idempotency.CloudEventFunc {
	return func(ctx context.Context, e cloudevents.Event) error {
		*ran++
		err := idempotency.Lock(ctx, s, "po:PO-1", func(context.Context) error { return nil })
		return fmt.Errorf("reserving stock: %w", err)
	}
}

// assertReleased checks that the message key is Claimed with a bumped fence
// (released by a failing body), not Done.
func assertReleased(t *testing.T, s *fake.Store, key string) {
	t.Helper()
	rec, ok := s.Record(key)
	if !ok || rec.State != store.Claimed || rec.Fence != 2 {
		t.Fatalf("record %q = %+v (present %v), want released (claimed, fence 2): the body failed", key, rec, ok)
	}
}

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

// Lock and Mutex hand a body's error back unchanged (errors.Is still sees
// a nested ErrDuplicate), release the claim, and let the caller tell the
// nested outcome from their own by the *DuplicateError's key.
func TestLockBodyErrorWrappingANestedOutcomeReleases(t *testing.T) {
	for _, verb := range []string{"Lock", "Mutex"} {
		t.Run(verb, func(t *testing.T) {
			s, _ := newStore(t)
			completeSubKey(t, s, "po:PO-1")
			call := idempotency.Lock
			if verb == "Mutex" {
				call = idempotency.Mutex
			}
			err := call(t.Context(), s, "m-1", func(ctx context.Context) error {
				return idempotency.Lock(ctx, s, "po:PO-1", func(context.Context) error { return nil })
			})
			var dup *idempotency.DuplicateError
			if !errors.Is(err, idempotency.ErrDuplicate) || !errors.As(err, &dup) || dup.Key != "po:PO-1" {
				t.Fatalf("err = %v, want the nested *DuplicateError for po:PO-1", err)
			}
			if idempotency.IsOwnDuplicate(err, "m-1") {
				t.Fatal("IsOwnDuplicate(err, m-1) = true for the body's nested duplicate")
			}
			assertReleased(t, s, "m-1")
			// Lock's own duplicate on a done key: a *DuplicateError with
			// that key and when suppression ends.
			err = idempotency.Lock(t.Context(), s, "po:PO-1", func(context.Context) error { t.Error("ran"); return nil })
			if !errors.As(err, &dup) || dup.Key != "po:PO-1" || dup.Until.IsZero() || !idempotency.IsOwnDuplicate(err, "po:PO-1") {
				t.Fatalf("own duplicate = %#v, want a *DuplicateError for po:PO-1 with Until", err)
			}
		})
	}
}

// A body can hand back an error that looks like Lock's own duplicate on
// the very key Lock holds: one it built itself, or one a nested Lock on
// the same key returned from another backend, wrapped. The body ran and
// failed, Lock released the key, so IsOwnDuplicate must say no, or the
// caller acks a failed delivery.
func TestIsOwnDuplicateIsNotForgedByTheBody(t *testing.T) {
	other, _ := newStore(t)
	completeSubKey(t, other, "m-1")
	forged := map[string]func(ctx context.Context) error{
		"built": func(context.Context) error { return &idempotency.DuplicateError{Key: "m-1"} },
		"wrapped nested Lock on another backend": func(ctx context.Context) error {
			err := idempotency.Lock(ctx, other, "m-1", func(context.Context) error { return nil })
			return fmt.Errorf("legacy store: %w", err)
		},
	}
	for name, body := range forged {
		t.Run(name, func(t *testing.T) {
			s, _ := newStore(t)
			err := idempotency.Lock(t.Context(), s, "m-1", body)
			if !errors.Is(err, idempotency.ErrDuplicate) {
				t.Fatalf("err = %v: Lock must still hand the body's error back unchanged", err)
			}
			if idempotency.IsOwnDuplicate(err, "m-1") {
				t.Fatalf("IsOwnDuplicate(%v, m-1) = true for a body's failure: the caller would ack it", err)
			}
			assertReleased(t, s, "m-1")
		})
	}
}
