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

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A 409's body says what happened (a payload mismatch) but carries no
// fingerprint: on main it returned the stored, unsalted SHA-256 of the
// payload that completed the key, an oracle on an endpoint without push
// auth. The fingerprints stay in the server's ERROR line. Through the
// real functions framework and through PushHandler.
func TestPayloadMismatchBodyCarriesNoFingerprint(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	l, logger := newLogs()
	opts := []idempotency.Option{idempotency.WithLogger(logger), idempotency.WithKey(idempotency.Attribute("po_id")), idempotency.WithKeyPrefix("orders:")}
	serve(t, idempotency.Idempotent(s, opts...)(h.handle))
	if code, body := post(t, "eventarc_binary"); code != http.StatusOK {
		t.Fatalf("first delivery: %d %s", code, body)
	}
	stored := fixtureFP()
	hexPart := stored[strings.LastIndexByte(stored, ':')+1:]
	srv := httptest.NewServer(idempotency.PushHandler(s, h.handle, opts...))
	defer srv.Close()
	for _, base := range []string{serverURL, srv.URL} {
		for _, name := range []string{"changed_payload", "changed_payload_raw"} {
			code, body := postTo(t, base, name)
			if code != http.StatusConflict || !strings.Contains(body, "payload mismatch") {
				t.Fatalf("%s: %d %q, want a 409 that says payload mismatch", name, code, body)
			}
			if strings.Contains(body, hexPart) || strings.Contains(body, idempotency.DataFingerprintScheme) {
				t.Errorf("%s: the body %q carries a fingerprint", name, body)
			}
		}
	}
	logged := l.find(t, "ERROR", "different payload")
	if len(logged) != 4 {
		t.Fatalf("%d ERROR lines, want one per mismatch (4)", len(logged))
	}
	for _, r := range logged {
		if r["stored_fingerprint"] != stored || r["delivered_fingerprint"] == nil {
			t.Errorf("the ERROR line %v lacks the fingerprints", r)
		}
	}
}

// WithPushAuth is read by PushHandler only: given to Idempotent, it was
// ignored without a word, and an endpoint its author meant to
// authenticate took every request. Idempotent now panics when it is
// called with it, as on its other mistakes in the program; PushHandler
// still takes it.
func TestIdempotentRefusesWithPushAuth(t *testing.T) {
	s, _ := newStore(t)
	deny := func(*http.Request) error { return errors.New("no") }
	func() {
		defer func() {
			msg, _ := recover().(string)
			if !strings.HasPrefix(msg, "idempotency.Idempotent: ") || !strings.Contains(msg, "WithPushAuth") || !strings.Contains(msg, "PushHandler") {
				t.Fatalf("Idempotent with WithPushAuth: panic %q, want a refusal that names WithPushAuth and PushHandler", msg)
			}
		}()
		idempotency.Idempotent(s, idempotency.WithPushAuth(deny))
	}()
	h := &counting{}
	if code := send(t, idempotency.PushHandler(s, h.handle, idempotency.WithPushAuth(deny), idempotency.WithLogger(newDiscard())), `{"message":{"messageId":"m-1"}}`, nil); code != http.StatusUnauthorized || h.runs() != 0 {
		t.Fatalf("PushHandler with a refusing verifier: HTTP %d, %d runs", code, h.runs())
	}
}

// Durations that cannot work are refused when the call is made, as zero
// and negative ones are: on main, WithHeartbeat(1ns) renewed the lease
// about a million times a second, and WithSettleTimeout(1ns) left no time
// for Complete, so Lock returned nil with the key still claimed and the
// next delivery ran the work again. Each option's floor is accepted.
func TestDurationsBelowTheirFloorAreRefused(t *testing.T) {
	noop := func(context.Context) error { return nil }
	for _, c := range []struct {
		name string
		opts []idempotency.LockOption
		bad  bool
	}{
		{"heartbeat 1ns", []idempotency.LockOption{idempotency.WithHeartbeat(time.Nanosecond)}, true},
		{"heartbeat below the floor", []idempotency.LockOption{idempotency.WithHeartbeat(idempotency.MinHeartbeat - 1)}, true},
		{"heartbeat at the floor", []idempotency.LockOption{idempotency.WithHeartbeat(idempotency.MinHeartbeat)}, false},
		{"settle timeout 1ns", []idempotency.LockOption{idempotency.WithSettleTimeout(time.Nanosecond)}, true},
		{"settle timeout below the floor", []idempotency.LockOption{idempotency.WithSettleTimeout(idempotency.MinSettleTimeout - 1)}, true},
		{"settle timeout at the floor", []idempotency.LockOption{idempotency.WithSettleTimeout(idempotency.MinSettleTimeout)}, false},
		{"lease 1ns", []idempotency.LockOption{idempotency.WithLease(time.Nanosecond)}, true},
		{"lease below the floor", []idempotency.LockOption{idempotency.WithLease(idempotency.MinLease - 1)}, true},
		{"lease at the floor", []idempotency.LockOption{idempotency.WithLease(idempotency.MinLease)}, false},
		{"lease from deadline, settle timeout 1ns", []idempotency.LockOption{idempotency.WithLeaseFromDeadline(0), idempotency.WithSettleTimeout(time.Nanosecond)}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := fake.New()
			err := idempotency.Lock(t.Context(), s, "k", noop, c.opts...)
			rec, _ := s.Record("k")
			switch {
			case c.bad && err == nil:
				t.Fatalf("Lock accepted it (record %+v)", rec)
			case c.bad && s.Len() != 0:
				t.Fatalf("Lock refused it (%v) after claiming: record %+v", err, rec)
			case !c.bad && (err != nil || rec.State != store.Done):
				t.Fatalf("Lock: %v, record %+v; want the key done", err, rec)
			}
			if c.bad && strings.Contains(c.name, "lease ") && !strings.Contains(c.name, "deadline") && !errors.Is(err, store.ErrInvalidLease) {
				t.Errorf("error %v, want ErrInvalidLease", err)
			}
			opts := make([]idempotency.Option, len(c.opts))
			for i, o := range c.opts {
				opts[i] = o
			}
			func() {
				defer func() {
					msg, _ := recover().(string)
					if c.bad != strings.HasPrefix(msg, "idempotency.Idempotent: ") {
						t.Fatalf("Idempotent: panic %q, want one: %v", msg, c.bad)
					}
				}()
				idempotency.Idempotent(s, opts...)
			}()
		})
	}
}

// A verifier's refusal reaches the server's log, not the unauthenticated
// client: its text may name what the endpoint expects (pushauth's names
// the push subscription's service account). And a verifier that panics
// on a request is a 500 with one ERROR line, not a dropped connection
// with a stack trace: nothing claimed, the handler not run.
func TestPushHandlerKeepsTheVerifiersWordsAndPanicsToItself(t *testing.T) {
	const secret = "push@my-project.iam.gserviceaccount.com"
	for _, c := range []struct {
		name   string
		verify func(*http.Request) error
		want   int
	}{
		{"unauthenticated", func(*http.Request) error { return errors.New("want a token of " + secret) }, http.StatusUnauthorized},
		{"forbidden", func(*http.Request) error {
			return fmt.Errorf("%w: the token is not %s's", idempotency.ErrPushForbidden, secret)
		}, http.StatusForbidden},
		{"panic", func(*http.Request) error { panic("verifier bug near " + secret) }, http.StatusInternalServerError},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, _ := newStore(t)
			h := &counting{}
			l, logger := newLogs()
			ph := idempotency.PushHandler(s, h.handle, idempotency.WithPushAuth(c.verify), idempotency.WithLogger(logger))
			var code int
			var body string
			func() {
				defer func() {
					if p := recover(); p != nil {
						t.Fatalf("PushHandler panicked: %v", p)
					}
				}()
				code, body = serveOnce(ph, unwrapped(`{"message":{"messageId":"m-1"}}`, nil))
			}()
			if code != c.want || h.runs() != 0 || s.Len() != 0 {
				t.Fatalf("HTTP %d %q, %d runs, %d records; want %d and nothing run or claimed", code, body, h.runs(), s.Len(), c.want)
			}
			if strings.Contains(body, secret) {
				t.Errorf("the body %q carries the verifier's words", body)
			}
			if recs := l.records(t); len(recs) != 1 || !strings.Contains(fmt.Sprint(recs[0]), secret) {
				t.Errorf("log %v, want one line with the verifier's words", recs)
			}
		})
	}
}
