package idempotency_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// fixtureFP is the default fingerprint of the fixtures' order (qty 3).
func fixtureFP() string {
	sum := sha256.Sum256([]byte(`{"order":{"id":"PO-1001","qty":3}}`))
	return idempotency.DataFingerprintScheme + ":" + hex.EncodeToString(sum[:16])
}

// Every shape of one message (Eventarc binary and structured, a raw push
// the framework converts) has one fingerprint: its redeliveries through
// the real functions framework are duplicates, never mismatches, and the
// record keeps the data's fingerprint.
func TestHTTPRedeliveryInEveryShapeIsADuplicateNotAMismatch(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	l, logger := newLogs()
	serve(t, idempotency.Idempotent(s, idempotency.WithLogger(logger))(h.handle))
	for _, name := range []string{"eventarc_binary", "eventarc_structured", "push_raw", "eventarc_binary", "push_raw", "eventarc_structured"} {
		if code, body := post(t, name); code != http.StatusOK {
			t.Fatalf("%s: %d %s, want 200 (a redelivery is a duplicate)", name, code, body)
		}
	}
	if h.runs() != 1 {
		t.Fatalf("handler ran %d times, want 1", h.runs())
	}
	if rec, _ := s.Record(fixtureID); rec.State != store.Done || rec.Fingerprint != fixtureFP() {
		t.Fatalf("record %+v, want done with fingerprint %q", rec, fixtureFP())
	}
	if got := l.find(t, "ERROR", "different payload"); len(got) != 0 {
		t.Fatalf("a redelivery was logged as a mismatch: %v", got)
	}
}

// Under a business key, the producer publishing the same order again is a
// duplicate; publishing it with another quantity is a mismatch: 409 (a
// nack), the handler does not run, an ERROR names both fingerprints, and
// the record keeps the first payload's. Through the real functions
// framework, in the binary and the raw push shape.
func TestHTTPChangedPayloadUnderABusinessKeyIsNackedNotAcked(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	l, logger := newLogs()
	serve(t, idempotency.Idempotent(s, idempotency.WithLogger(logger),
		idempotency.WithKey(idempotency.Attribute("po_id")), idempotency.WithKeyPrefix("orders:"))(h.handle))
	for _, name := range []string{"eventarc_binary", "republish"} {
		if code, body := post(t, name); code != http.StatusOK {
			t.Fatalf("%s: %d %s", name, code, body)
		}
	}
	for _, name := range []string{"changed_payload", "changed_payload_raw", "changed_payload"} {
		code, body := post(t, name)
		if code != http.StatusConflict || pubsubAcks[code] {
			t.Fatalf("%s: %d %s, want 409 (a nack)", name, code, body)
		}
		if !strings.Contains(body, "payload mismatch") {
			t.Errorf("%s: body %q does not say payload mismatch", name, body)
		}
	}
	if h.runs() != 1 {
		t.Fatalf("handler ran %d times, want 1 (the changed order must not run over a done key)", h.runs())
	}
	if rec, _ := s.Record("orders:PO-1001"); rec.Fingerprint != fixtureFP() {
		t.Fatalf("record %+v, want the first payload's fingerprint kept", rec)
	}
	logged := l.find(t, "ERROR", "different payload")
	if len(logged) != 3 {
		t.Fatalf("%d ERROR lines for 3 mismatches", len(logged))
	}
	if r := logged[0]; r["stored_fingerprint"] != fixtureFP() || r["delivered_fingerprint"] == fixtureFP() ||
		!strings.HasPrefix(fmt.Sprint(r["delivered_fingerprint"]), idempotency.DataFingerprintScheme+":") || r["key"] != "orders:PO-1001" {
		t.Fatalf("the ERROR line %v lacks the key or the fingerprints", r)
	}
	if got := l.find(t, "INFO", "duplicate"); len(got) != 1 {
		t.Fatalf("%d duplicate lines, want 1 (the republish)", len(got))
	}
}

// The same through PushHandler: every wrapped shape and an unwrapped push
// of the same message are duplicates; the changed order is a 409 in each,
// logged once with both fingerprints.
func TestPushHandlerChangedPayloadIs409AndRedeliveriesAreDuplicates(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	l, logger := newLogs()
	opts := []idempotency.Option{idempotency.WithLogger(logger), idempotency.WithKey(idempotency.Attribute("po_id")), idempotency.WithKeyPrefix("orders:")}
	srv := httptest.NewServer(idempotency.PushHandler(s, h.handle, opts...))
	defer srv.Close()
	for _, name := range []string{"push_raw", "eventarc_binary", "eventarc_structured", "republish"} {
		if code := pushTo(t, srv.URL, name); code != http.StatusNoContent {
			t.Fatalf("%s: HTTP %d, want 204", name, code)
		}
	}
	un := idempotency.PushHandler(s, h.handle, append(opts, idempotency.WithUnwrappedPush("po_id"))...)
	if code, body := serveOnce(un, unwrapped(`{"order":{"id":"PO-1001","qty":3}}`, metadata("55555555555555"))); code != http.StatusNoContent {
		t.Fatalf("unwrapped redelivery: %d %s, want 204", code, body)
	}
	for _, name := range []string{"changed_payload", "changed_payload_raw"} {
		if code := pushTo(t, srv.URL, name); code != http.StatusConflict {
			t.Fatalf("%s: HTTP %d, want 409", name, code)
		}
	}
	if code, body := serveOnce(un, unwrapped(`{"order":{"id":"PO-1001","qty":999}}`, metadata("55555555555556"))); code != http.StatusConflict {
		t.Fatalf("unwrapped changed order: %d %s, want 409", code, body)
	}
	if h.runs() != 1 {
		t.Fatalf("handler ran %d times, want 1", h.runs())
	}
	if got := l.find(t, "ERROR", ""); len(got) != 3 {
		t.Fatalf("%d ERROR lines, want one per mismatch (3): %v", len(got), got)
	}
}

// WithFingerprint(nil) turns the check off: the changed order is acked as
// a duplicate, as before fingerprints, and nothing is stored.
func TestHTTPFingerprintsOffTakeAChangedPayloadForADuplicate(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s, idempotency.WithLogger(newDiscard()), idempotency.WithFingerprint(nil),
		idempotency.WithKey(idempotency.Attribute("po_id")))(h.handle))
	for _, name := range []string{"eventarc_binary", "changed_payload"} {
		if code, body := post(t, name); code != http.StatusOK {
			t.Fatalf("%s: %d %s", name, code, body)
		}
	}
	if rec, _ := s.Record("PO-1001"); h.runs() != 1 || rec.Fingerprint != "" {
		t.Fatalf("runs %d, record %+v; want 1 run and no fingerprint", h.runs(), rec)
	}
}

// A record completed without a fingerprint (before fingerprints, or with
// them off) keeps acking every later delivery of its key as a duplicate.
func TestARecordWithoutAFingerprintKeepsBeingAPlainDuplicate(t *testing.T) {
	s, _ := newStore(t)
	var runs int
	body := func(context.Context, cloudevents.Event) error { runs++; return nil }
	key := idempotency.WithKey(idempotency.Attribute("po_id"))
	old := idempotency.Idempotent(s, key, idempotency.WithFingerprint(nil), idempotency.WithLogger(newDiscard()))(body)
	now := idempotency.Idempotent(s, key, idempotency.WithLogger(newDiscard()))(body)
	order := func(qty int) cloudevents.Event {
		return pubsubEvent(t, fmt.Sprint("m-", qty), map[string]any{"messageId": fmt.Sprint("m-", qty),
			"attributes": map[string]string{"po_id": "PO-1"}, "data": payload(map[string]int{"qty": qty})})
	}
	if err := old(t.Context(), order(1)); err != nil {
		t.Fatal(err)
	}
	if err := now(t.Context(), order(999)); err != nil || runs != 1 {
		t.Fatalf("a changed payload over a record without a fingerprint: %v, runs %d; want a duplicate (nil, 1 run)", err, runs)
	}
}

// The fingerprint functions: data alone by default; attributes by name, in
// any order, an absent one told from an empty one; schemes that say which.
func TestPayloadFingerprint(t *testing.T) {
	ev := func(data string, attrs map[string]string) cloudevents.Event {
		m := map[string]any{"messageId": "1", "data": payload(data)}
		if attrs != nil {
			m["attributes"] = attrs
		}
		return pubsubEvent(t, "1", m)
	}
	fp := func(f idempotency.FingerprintFunc, e cloudevents.Event) string {
		t.Helper()
		s, err := f(e)
		if err != nil || store.ValidateFingerprint(s) != nil {
			t.Fatalf("fingerprint %q, %v", s, err)
		}
		return s
	}
	def := idempotency.PayloadFingerprint()
	a := fp(def, ev("a", map[string]string{"trace": "1"}))
	if !strings.HasPrefix(a, idempotency.DataFingerprintScheme+":") || len(a) > 64 {
		t.Fatalf("default fingerprint %q", a)
	}
	if b := fp(def, ev("a", map[string]string{"trace": "2"})); b != a {
		t.Errorf("the default changed with an attribute: %q, %q", a, b)
	}
	if b := fp(def, ev("b", nil)); b == a {
		t.Errorf("the default did not change with the data")
	}
	ab, ba := idempotency.PayloadFingerprint("x", "y"), idempotency.PayloadFingerprint("y", "x", "x")
	e := ev("a", map[string]string{"x": "1", "y": "2"})
	if fp(ab, e) != fp(ba, e) {
		t.Errorf("the order of the attribute names matters")
	}
	if fp(ab, e) == fp(ab, ev("a", map[string]string{"x": "1", "y": "3"})) {
		t.Errorf("a named attribute's value does not count")
	}
	if fp(ab, ev("a", map[string]string{"x": "1"})) == fp(ab, ev("a", map[string]string{"x": "1", "y": ""})) {
		t.Errorf("an absent attribute and an empty one fingerprint alike")
	}
	scheme := func(s string) string { return s[:strings.LastIndexByte(s, ':')] }
	x := idempotency.PayloadFingerprint("x")
	if scheme(fp(x, e)) == scheme(fp(ab, e)) || scheme(fp(x, e)) == scheme(a) {
		t.Errorf("schemes do not tell the attribute sets apart: %q %q %q", fp(x, e), fp(ab, e), a)
	}
	// Not a Pub/Sub envelope: no fingerprint, no error.
	other := cloudevents.NewEvent()
	other.SetID("1")
	other.SetType("com.example")
	other.SetSource("x")
	_ = other.SetData(cloudevents.ApplicationJSON, map[string]any{"order": 1})
	if s := fp(def, other); s != "" {
		t.Errorf("fingerprint %q for an event that is not a Pub/Sub message", s)
	}
}

// Lock with a payload fingerprint: a mismatch is its own error, never a
// duplicate, and the body does not run; the same fingerprint, none, or one
// of another scheme is a duplicate; Mutex ignores it.
func TestLockWithAPayloadFingerprint(t *testing.T) {
	s, _ := newStore(t)
	ctx := t.Context()
	ran := 0
	body := func(context.Context) error { ran++; return nil }
	if err := idempotency.Lock(ctx, s, "k", body, idempotency.WithPayloadFingerprint("v1:aaaa")); err != nil {
		t.Fatal(err)
	}
	if rec, _ := s.Record("k"); rec.Fingerprint != "v1:aaaa" {
		t.Fatalf("record %+v, want the fingerprint stored", rec)
	}
	for _, fp := range []string{"v1:aaaa", "", "v2:bbbb"} {
		if err := idempotency.Lock(ctx, s, "k", body, idempotency.WithPayloadFingerprint(fp)); !idempotency.IsOwnDuplicate(err, "k") {
			t.Errorf("fingerprint %q: %v, want Lock's own duplicate", fp, err)
		}
	}
	err := idempotency.Lock(ctx, s, "k", body, idempotency.WithPayloadFingerprint("v1:bbbb"))
	var pm *idempotency.PayloadMismatchError
	if !errors.As(err, &pm) || !errors.Is(err, idempotency.ErrPayloadMismatch) || errors.Is(err, idempotency.ErrDuplicate) ||
		idempotency.IsOwnDuplicate(err, "k") || pm.Key != "k" || pm.Stored != "v1:aaaa" || pm.Delivered != "v1:bbbb" || pm.Until.IsZero() {
		t.Fatalf("a different fingerprint: %#v, want a *PayloadMismatchError that is not a duplicate", err)
	}
	if ran != 1 {
		t.Fatalf("the body ran %d times, want 1", ran)
	}
	var ip *idempotency.InProgressError
	if err := idempotency.Mutex(ctx, s, "k", body, idempotency.WithPayloadFingerprint("v1:bbbb")); !errors.As(err, &ip) || !ip.Done {
		t.Fatalf("Mutex over a done key: %v, want in progress (done)", err)
	}
	// An invalid fingerprint is refused before the claim.
	claims := s.Calls(fake.OpClaim)
	for _, bad := range []string{strings.Repeat("f", store.MaxFingerprintLen+1), "nul\x00", "\xff"} {
		if err := idempotency.Lock(ctx, s, "fresh", body, idempotency.WithPayloadFingerprint(bad)); !errors.Is(err, store.ErrInvalidFingerprint) {
			t.Errorf("fingerprint %q: %v, want ErrInvalidFingerprint", bad, err)
		}
	}
	if s.Calls(fake.OpClaim) != claims || ran != 1 {
		t.Fatalf("an invalid fingerprint reached the backend or the body")
	}
}

// plainBackend is the fake without store.Fingerprinter.
type plainBackend struct{ b store.Backend }

func (p plainBackend) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	return p.b.Claim(ctx, key, lease)
}
func (p plainBackend) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return p.b.Complete(ctx, c)
}
func (p plainBackend) Release(ctx context.Context, c store.Claim) error { return p.b.Release(ctx, c) }

// On a backend that does not implement store.Fingerprinter, Idempotent
// warns once, when it is called, and every done key is a plain duplicate.
func TestABackendWithoutFingerprintsWarnsOnceAndDeduplicatesAsBefore(t *testing.T) {
	s, _ := newStore(t)
	l, logger := newLogs()
	var runs int
	f := idempotency.Idempotent(plainBackend{s}, idempotency.WithLogger(logger), idempotency.WithKey(idempotency.Attribute("po_id")))(
		func(context.Context, cloudevents.Event) error { runs++; return nil })
	for qty := range 3 {
		e := pubsubEvent(t, fmt.Sprint(qty), map[string]any{"messageId": fmt.Sprint(qty),
			"attributes": map[string]string{"po_id": "PO-1"}, "data": payload(qty)})
		if err := f(t.Context(), e); err != nil {
			t.Fatal(err)
		}
	}
	if runs != 1 || len(l.find(t, "WARN", "store.Fingerprinter")) != 1 {
		t.Fatalf("runs %d, warnings %v; want 1 run and one warning", runs, l.find(t, "WARN", "store.Fingerprinter"))
	}
	if rec, _ := s.Record("PO-1"); rec.Fingerprint != "" {
		t.Fatalf("record %+v: a fingerprint was stored through a backend without Fingerprinter", rec)
	}
}

// A FingerprintFunc's error nacks before anything is claimed: 400 when it
// blames the message (ErrMalformedEvent), 500 otherwise, and 500 for a
// fingerprint the port refuses.
func TestFingerprintFuncErrorsNackWithoutClaiming(t *testing.T) {
	for _, tc := range []struct {
		name string
		f    idempotency.FingerprintFunc
		want int
	}{
		{"malformed", func(cloudevents.Event) (string, error) {
			return "", fmt.Errorf("no order: %w", idempotency.ErrMalformedEvent)
		}, http.StatusBadRequest},
		{"failed", func(cloudevents.Event) (string, error) { return "", errors.New("boom") }, http.StatusInternalServerError},
		{"too long", func(cloudevents.Event) (string, error) { return strings.Repeat("f", 200), nil }, http.StatusInternalServerError},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newStore(t)
			h := &counting{}
			srv := httptest.NewServer(idempotency.PushHandler(s, h.handle, idempotency.WithLogger(newDiscard()), idempotency.WithFingerprint(tc.f)))
			defer srv.Close()
			if code := pushTo(t, srv.URL, "push_raw"); code != tc.want {
				t.Fatalf("HTTP %d, want %d", code, tc.want)
			}
			if h.runs() != 0 || s.Calls(fake.OpClaim) != 0 {
				t.Fatalf("runs %d, claims %d; want none", h.runs(), s.Calls(fake.OpClaim))
			}
		})
	}
}
