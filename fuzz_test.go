package idempotency

// Fuzz targets for every parser of untrusted input in this package. Their
// seed corpora are the request fixtures in testdata/*.http (plus the
// crashers Go keeps under testdata/fuzz/). scripts/fuzz.sh runs them all.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cloudevents/sdk-go/v2/event"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// seed is one request fixture from testdata/.
type seed struct {
	name string
	head http.Header
	body []byte
}

// seeds reads every testdata/*.http fixture.
func seeds(f *testing.F) []seed {
	f.Helper()
	paths, err := filepath.Glob(filepath.Join("testdata", "*.http"))
	if err != nil || len(paths) == 0 {
		f.Fatalf("no fixtures in testdata: %v", err)
	}
	var out []seed
	for _, p := range paths {
		raw, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		head, body, ok := bytes.Cut(raw, []byte("\n\n"))
		if !ok {
			f.Fatalf("%s: no blank line after the headers", p)
		}
		req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(append(head, "\n\n"...))))
		if err != nil {
			f.Fatalf("%s: %v", p, err)
		}
		out = append(out, seed{name: filepath.Base(p), head: req.Header, body: bytes.TrimRight(body, "\n")})
	}
	return out
}

// envelopes are the seeds' Pub/Sub envelopes (a structured CloudEvent's
// data, a binary one's body) plus a few hostile shapes.
func envelopes(f *testing.F) [][]byte {
	var out [][]byte
	for _, s := range seeds(f) {
		if strings.Contains(s.head.Get("Content-Type"), "cloudevents") {
			var ce struct {
				Data json.RawMessage `json:"data"`
			}
			if json.Unmarshal(s.body, &ce) == nil {
				out = append(out, ce.Data)
			}
			continue
		}
		out = append(out, s.body)
	}
	return append(out,
		[]byte(`{"message":{"messageId":"a\u0000b"}}`),
		[]byte(`{"message":{"messageId":"`+strings.Repeat("k", store.MaxKeyLen+1)+`"}}`),
		[]byte(`{"message":{"MessageID":"x","messageId":"y"},"MESSAGE":{}}`),
		[]byte(`{"message":{"message_id":7}}`),
		[]byte(`{"message":null}`),
		[]byte(`[]`),
		[]byte{},
	)
}

// newEvent is a CloudEvent with the given type and id whose data is the
// raw bytes data, as the SDK leaves a binary-mode body.
func newEvent(typ, id string, data []byte) event.Event {
	e := event.New()
	e.SetType(typ)
	e.SetID(id)
	e.SetSource("//pubsub.googleapis.com/projects/p/topics/t")
	e.DataEncoded = data
	e.SetDataContentType(event.ApplicationJSON)
	return e
}

// refMessageID reads data.message.messageId the plain way, case-sensitively,
// and reports it only when the envelope is unambiguous: one top-level key
// spelled like "message" in any case, and it is "message"; one key in the
// message spelled like "messageId" in any case, and it is "messageId".
func refMessageID(data []byte) (string, bool) {
	var top map[string]json.RawMessage
	if json.Unmarshal(data, &top) != nil {
		return "", false
	}
	only := func(m map[string]json.RawMessage, name string) (json.RawMessage, bool) {
		var hits []string
		for k := range m {
			if strings.EqualFold(k, name) {
				hits = append(hits, k)
			}
		}
		if len(hits) != 1 || hits[0] != name {
			return nil, false
		}
		return m[name], true
	}
	msgRaw, ok := only(top, "message")
	if !ok {
		return "", false
	}
	var msg map[string]json.RawMessage
	if json.Unmarshal(msgRaw, &msg) != nil {
		return "", false
	}
	idRaw, ok := only(msg, "messageId")
	if !ok {
		return "", false
	}
	var id string
	if json.Unmarshal(idRaw, &id) != nil || id == "" {
		return "", false
	}
	return id, true
}

// FuzzParsePubSub: ParsePubSub and the default key read the same envelope
// the same way, only malformed data is an error, and the default key is the
// envelope's messageId.
func FuzzParsePubSub(f *testing.F) {
	for _, env := range envelopes(f) {
		f.Add(env, PubSubEventType, "11223344556677")
		f.Add(env, "com.example.v1", "")
	}
	f.Fuzz(func(t *testing.T, data []byte, typ, id string) {
		e := newEvent(typ, id, data)
		ev, err := ParsePubSub(e)
		if err != nil && !errors.Is(err, ErrMalformedEvent) {
			t.Fatalf("ParsePubSub error %v does not wrap ErrMalformedEvent", err)
		}
		key, kerr := MessageID()(e)
		if kerr != nil && !errors.Is(kerr, ErrMalformedEvent) && !errors.Is(kerr, store.ErrInvalidKey) {
			t.Fatalf("MessageID error %v wraps neither ErrMalformedEvent nor store.ErrInvalidKey", kerr)
		}
		if errors.Is(kerr, ErrMalformedEvent) && err == nil {
			t.Fatalf("MessageID calls the data malformed (%v) but ParsePubSub read it", kerr)
		}
		if err == nil {
			switch {
			case kerr == nil && key != ev.Message.ID:
				t.Fatalf("default key %q, ParsePubSub's ID %q", key, ev.Message.ID)
			case errors.Is(kerr, store.ErrInvalidKey) && store.ValidateKey(ev.Message.ID) == nil:
				t.Fatalf("MessageID refused the valid id %q: %v", ev.Message.ID, kerr)
			}
		}
		if kerr == nil && key != "" {
			if verr := store.ValidateKey(key); verr != nil {
				t.Fatalf("MessageID returned the key %q the port refuses: %v", key, verr)
			}
		}
		if ref, ok := refMessageID(data); ok && kerr == nil && key != ref {
			t.Fatalf("default key %q, but the envelope's messageId is %q", key, ref)
		}
		// (The SDK trims the id: compare with what the event holds.)
		if kerr == nil && key == "" && typ == PubSubEventType && e.ID() != "" {
			t.Fatalf("a Pub/Sub event with id %q got no key", e.ID())
		}
	})
}

// FuzzKeyFuncs: no KeyFunc of this package returns a key that
// store.ValidateKey refuses; it returns an error (or no key) instead.
func FuzzKeyFuncs(f *testing.F) {
	for _, env := range envelopes(f) {
		f.Add(env, PubSubEventType, "1", "po_id", "order", "id")
	}
	f.Add([]byte(`{"message":{"messageId":"1","data":"eyJvcmRlciI6eyJpZCI6ImFcdTAwMDBiIn19","attributes":{"k":"a\u0000"}}}`),
		PubSubEventType, "1", "k", "order", "id")
	f.Fuzz(func(t *testing.T, data []byte, typ, id, attr, p1, p2 string) {
		e := newEvent(typ, id, data)
		funcs := map[string]KeyFunc{
			"MessageID":        MessageID(),
			"Attribute":        Attribute(attr),
			"JSONField(p1)":    JSONField(p1),
			"JSONField(p1,p2)": JSONField(p1, p2),
			"JSONField()":      JSONField(),
		}
		for name, kf := range funcs {
			key, err := kf(e)
			if err != nil {
				if key != "" {
					t.Fatalf("%s returned both a key %q and an error %v", name, key, err)
				}
				continue
			}
			if key == "" {
				continue
			}
			if verr := store.ValidateKey(key); verr != nil {
				t.Fatalf("%s returned the key %q, which the port refuses: %v", name, key, verr)
			}
		}
		if ev, err := ParsePubSub(e); err == nil {
			want, has := ev.Message.Attributes[attr]
			if key, kerr := Attribute(attr)(e); has && store.ValidateKey(want) == nil && (kerr != nil || key != want) {
				t.Fatalf("Attribute(%q) = %q, %v; the attribute is %q", attr, key, kerr, want)
			}
		}
	})
}

// FuzzKeyPrefix: two prefixes WithKeyPrefix accepts never compose the same
// key from different (prefix, key) pairs.
func FuzzKeyPrefix(f *testing.F) {
	f.Add("orders:", "refunds:1", "orders:refunds:", "1")
	f.Add("orders:", "1", "orders.refunds:", "1")
	f.Add("a:", "b:c", "a:b:", "c")
	f.Fuzz(func(t *testing.T, p1, k1, p2, k2 string) {
		if validatePrefix(p1) != nil || validatePrefix(p2) != nil || k1 == "" || k2 == "" {
			return
		}
		if p1+k1 == p2+k2 && (p1 != p2 || k1 != k2) {
			t.Fatalf("(%q, %q) and (%q, %q) compose the same key", p1, k1, p2, k2)
		}
	})
}

// pubsubAcks are the push response statuses Pub/Sub counts as an ack.
var pubsubAcks = map[int]bool{102: true, 200: true, 201: true, 202: true, 204: true}

// failWith are the errors the fuzzed handler may fail with: a plain error,
// results with ack, redirect, informational and nack statuses, and a
// nested Lock's duplicate.
var failWith = []error{
	errors.New("boom"),
	cehttp.NewResult(202, "accepted"),
	cehttp.NewResult(102, "processing"),
	cehttp.NewResult(302, "elsewhere"),
	cehttp.NewResult(0, "zero"),
	cehttp.NewResult(429, "slow down"),
	fmt.Errorf("inner: %w", &DuplicateError{Key: "inner"}),
	fmt.Errorf("inner: %w", &InProgressError{Key: "inner"}),
}

var discard = slog.New(slog.DiscardHandler)

// FuzzPushHandler posts arbitrary requests to a PushHandler on a fresh
// store. Whatever the input: no panic; a request PushHandler cannot parse,
// or a handler that fails or does not run, never gets an ack status; an
// ack means the handler ran once, succeeded, and its key is Done; a failed
// run leaves its key released; the key is the event's default key (a
// Pub/Sub message's is its envelope's messageId).
func FuzzPushHandler(f *testing.F) {
	for _, s := range seeds(f) {
		for _, mode := range []uint8{0, 1, 2, 7} {
			f.Add(s.body, s.head.Get("Content-Type"), s.head.Get("Ce-Id"), s.head.Get("Ce-Type"), s.head.Get("Ce-Specversion"), mode)
		}
	}
	f.Add([]byte(`{"message":{"messageId":"m","data":"%%%"}}`), "application/json", "", "", "", uint8(0))
	f.Add([]byte(`{"specversion":"1.0","id":"x","source":"s","type":"t","data":{}}`), "application/cloudevents+json", "", "", "", uint8(0))
	f.Add([]byte(``), "", "", "", "", uint8(0))
	f.Add([]byte(`{"message":{}}`), "text/plain", "1", PubSubEventType, "1.0", uint8(0))
	f.Fuzz(func(t *testing.T, body []byte, ctype, ceID, ceType, ceSpec string, mode uint8) {
		s := fake.New()
		ran := 0
		var seen event.Event
		h := func(ctx context.Context, e event.Event) error {
			ran++
			seen = e
			if mode == 0 {
				return nil
			}
			return failWith[int(mode-1)%len(failWith)]
		}
		req := func() *http.Request {
			r := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body))
			for k, v := range map[string]string{"Content-Type": ctype, "Ce-Id": ceID, "Ce-Type": ceType, "Ce-Specversion": ceSpec} {
				if v != "" && !strings.ContainsAny(v, "\r\n") {
					r.Header.Set(k, v)
				}
			}
			if ceID != "" {
				r.Header.Set("Ce-Source", "//pubsub.googleapis.com/projects/p/topics/t")
			}
			return r
		}
		_, _, perr := pushEvent(req())
		w := httptest.NewRecorder()
		PushHandler(s, h, WithLogger(discard)).ServeHTTP(w, req())
		code := w.Code
		switch {
		case perr != nil && (ran != 0 || code < 400 || code > 499):
			t.Fatalf("unparseable request (%v): HTTP %d, handler ran %d times; want a 4xx and no run", perr, code, ran)
		case ran > 1:
			t.Fatalf("the handler ran %d times for one request", ran)
		case ran == 0 && pubsubAcks[code]:
			t.Fatalf("HTTP %d (ack) on a fresh store, but the handler never ran", code)
		case ran == 1 && mode != 0 && (code < 400 || code > 599):
			t.Fatalf("the handler failed and PushHandler answered %d", code)
		case ran == 1 && mode == 0 && code != http.StatusNoContent:
			t.Fatalf("the handler succeeded and PushHandler answered %d", code)
		}
		if ran == 0 {
			if s.Len() != 0 {
				t.Fatalf("no run, HTTP %d, but %d records", code, s.Len())
			}
			return
		}
		key, err := DefaultKey()(seen)
		if err != nil || key == "" {
			t.Fatalf("the handler ran for an event without a default key (%q, %v)", key, err)
		}
		rec, ok := s.Record(key)
		want := store.Done
		if mode != 0 {
			want = store.Claimed
		}
		if !ok || rec.State != want || s.Len() != 1 {
			t.Fatalf("record under the default key %q: %+v (present %v, %d records); want %v", key, rec, ok, s.Len(), want)
		}
		// A Pub/Sub message is keyed by its envelope's messageId; any
		// other event by its source and id (DefaultKey).
		if ref, ok := refMessageID(seen.Data()); ok && seen.Type() == PubSubEventType && joinKeyParts([]string{ref}) != key {
			t.Fatalf("the record key %q is not the envelope's messageId %q", key, ref)
		}
		_, _ = io.Copy(io.Discard, w.Body)
	})
}

// FuzzPushHandlerUnwrapped posts arbitrary bodies, with or without the
// message id header of an unwrapped push and a Ce-Id or Content-Type an
// attribute could have made, to a PushHandler with and without
// WithUnwrappedPush. Whatever the input: no ack unless the handler ran
// once and succeeded; with the option the handler's data is the body byte
// for byte and nothing is keyed without a message id header; with or
// without it, a request with that header is keyed on that header's value
// or not at all, never on what the body says.
func FuzzPushHandlerUnwrapped(f *testing.F) {
	for _, s := range seeds(f) {
		f.Add(s.body, "m-1", s.head.Get("Ce-Id"), s.head.Get("Content-Type"), true, uint8(0))
		f.Add(s.body, "m-1", s.head.Get("Ce-Id"), s.head.Get("Content-Type"), false, uint8(0))
		f.Add(s.body, "", "", "", true, uint8(0))
	}
	f.Add([]byte(`{"message":{"messageId":"forged"}}`), "m-1", "", "application/json", false, uint8(0))
	f.Add([]byte(`{"message":{"messageId":"m-1"}}`), "m-1", "", "", false, uint8(0))
	f.Add([]byte(`{"message":{"messageId":"forged"}}`), "m-1", "forged", "application/cloudevents+json", true, uint8(1))
	f.Fuzz(func(t *testing.T, body []byte, msgID, ceID, ctype string, unwrappedMode bool, mode uint8) {
		s := fake.New()
		ran := 0
		var seen event.Event
		h := func(ctx context.Context, e event.Event) error {
			ran++
			seen = e
			if mode == 0 {
				return nil
			}
			return failWith[int(mode-1)%len(failWith)]
		}
		r := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body))
		for k, v := range map[string]string{PushMessageIDHeader: msgID, "Ce-Id": ceID, "Content-Type": ctype} {
			if v != "" && !strings.ContainsAny(v, "\r\n") {
				r.Header.Set(k, v)
			}
		}
		if ceID != "" {
			r.Header.Set("Ce-Type", PubSubEventType)
			r.Header.Set("Ce-Specversion", "1.0")
			r.Header.Set("Ce-Source", "//pubsub.googleapis.com/projects/p/topics/t")
		}
		_, withID := r.Header[PushMessageIDHeader]
		opts := []Option{WithLogger(discard)}
		if unwrappedMode {
			opts = append(opts, WithUnwrappedPush())
		}
		w := httptest.NewRecorder()
		PushHandler(s, h, opts...).ServeHTTP(w, r)
		code := w.Code
		switch {
		case ran > 1:
			t.Fatalf("the handler ran %d times for one request", ran)
		case ran == 0 && pubsubAcks[code]:
			t.Fatalf("HTTP %d (ack) on a fresh store, but the handler never ran", code)
		case ran == 1 && mode != 0 && (code < 400 || code > 599):
			t.Fatalf("the handler failed and PushHandler answered %d", code)
		case ran == 1 && mode == 0 && code != http.StatusNoContent:
			t.Fatalf("the handler succeeded and PushHandler answered %d", code)
		case unwrappedMode && !withID && ran != 0:
			t.Fatalf("an unwrapped push without a message id ran under the default key (HTTP %d)", code)
		}
		if ran == 0 {
			if s.Len() != 0 {
				t.Fatalf("no run, HTTP %d, but %d records", code, s.Len())
			}
			return
		}
		if unwrappedMode {
			ev, err := ParsePubSub(seen)
			if err != nil || !bytes.Equal(ev.Message.Data, body) {
				t.Fatalf("the handler's data %q (%v) is not the body %q", ev.Message.Data, err, body)
			}
		}
		if withID {
			if _, ok := s.Record(r.Header.Get(PushMessageIDHeader)); !ok || s.Len() != 1 {
				t.Fatalf("HTTP %d: the record is not under the message id header %q (%d records)", code, r.Header.Get(PushMessageIDHeader), s.Len())
			}
		}
	})
}

// FuzzEventIDIsInjective: EventID never gives two different (source, id)
// pairs one key, and DefaultKey never gives a Pub/Sub message the key of
// another event, so that a different event is never acked as a
// duplicate.
func FuzzEventIDIsInjective(f *testing.F) {
	f.Add("a|b", "c", "a", "b|c")
	f.Add(`a\`, "|c", `a\|`, "c")
	f.Add("//storage.googleapis.com/projects/_/buckets/b", "1", "//storage.googleapis.com/projects/_/buckets/b", "2")
	f.Fuzz(func(t *testing.T, s1, id1, s2, id2 string) {
		e1, e2 := event.New(), event.New()
		e1.SetType("com.example.v1")
		e2.SetType("com.example.v1")
		e1.SetSource(s1)
		e1.SetID(id1)
		e2.SetSource(s2)
		e2.SetID(id2)
		k1, err1 := eventID(e1)
		k2, err2 := eventID(e2)
		if err1 != nil || err2 != nil || k1 == "" || k2 == "" {
			return
		}
		if same := e1.Source() == e2.Source() && e1.ID() == e2.ID(); (k1 == k2) != same {
			t.Fatalf("(%q, %q) and (%q, %q): keys %q and %q", e1.Source(), e1.ID(), e2.Source(), e2.ID(), k1, k2)
		}
		// Nor is a Pub/Sub message under DefaultKey ever keyed as another
		// event: its messageId spelled as the other's key, or any other.
		for _, id := range []string{k1, s1, id1} {
			env, _ := json.Marshal(map[string]any{"message": map[string]any{"messageId": id}})
			m := event.New()
			m.SetType(PubSubEventType)
			m.SetSource("//pubsub.googleapis.com/projects/p/topics/t")
			m.SetID("ce")
			if m.SetData("application/json", env) != nil {
				continue
			}
			if km, err := defaultKey(m); err == nil && km == k1 {
				t.Fatalf("the message with messageId %q and the event (%q, %q) share the key %q", id, e1.Source(), e1.ID(), km)
			}
		}
	})
}
