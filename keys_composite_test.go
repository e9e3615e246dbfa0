package idempotency_test

import (
	"context"
	"encoding/base64"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// compositeEvent is a Pub/Sub CloudEvent whose message has the attributes
// attrs (none when nil) and the data payload, byte for byte.
func compositeEvent(t testing.TB, attrs map[string]string, payload string) cloudevents.Event {
	t.Helper()
	msg := map[string]any{"messageId": "m-1", "data": base64.StdEncoding.EncodeToString([]byte(payload))}
	if attrs != nil {
		msg["attributes"] = attrs
	}
	e := cloudevents.NewEvent()
	e.SetID("m-1")
	e.SetSource("//pubsub.googleapis.com/projects/p/topics/t")
	e.SetType(idempotency.PubSubEventType)
	if err := e.SetData(cloudevents.ApplicationJSON, map[string]any{"message": msg}); err != nil {
		t.Fatal(err)
	}
	return e
}

var tenantAndOrder = idempotency.CompositeKey(idempotency.AttributePart("tenant"), idempotency.JSONFieldPart("order", "id"))

// TestCompositeKeyOfEachTuple pins CompositeKey's key: each part as the
// single KeyFunc reads it, escaped, joined by "|"; an absent or empty part
// makes the event unkeyed; a malformed part is the message's fault and is
// named, whatever the other parts hold.
func TestCompositeKeyOfEachTuple(t *testing.T) {
	cases := []struct {
		name      string
		attrs     map[string]string
		payload   string
		key       string // "" for unkeyed
		malformed string // the part the error names
	}{
		{"plain", map[string]string{"tenant": "acme"}, `{"order":{"id":"PO-1"}}`, "acme|PO-1", ""},
		{"a number field", map[string]string{"tenant": "acme"}, `{"order":{"id":1}}`, "acme|json:1", ""},
		{"a string that looks like a number", map[string]string{"tenant": "acme"}, `{"order":{"id":"json:1"}}`, `acme|json:"json:1"`, ""},
		{"separator in the first part", map[string]string{"tenant": "a|b"}, `{"order":{"id":"c"}}`, `a\|b|c`, ""},
		{"separator in the second part", map[string]string{"tenant": "a"}, `{"order":{"id":"b|c"}}`, `a|b\|c`, ""},
		{"backslash before the separator", map[string]string{"tenant": `a\`}, `{"order":{"id":"b"}}`, `a\\|b`, ""},
		{"escaped separator spelled out", map[string]string{"tenant": `a\|b`}, `{"order":{"id":"c"}}`, `a\\\|b|c`, ""},
		{"absent attribute", nil, `{"order":{"id":"PO-1"}}`, "", ""},
		{"empty attribute", map[string]string{"tenant": ""}, `{"order":{"id":"PO-1"}}`, "", ""},
		{"absent field", map[string]string{"tenant": "acme"}, `{"order":{}}`, "", ""},
		{"null field", map[string]string{"tenant": "acme"}, `{"order":{"id":null}}`, "", ""},
		{"path through a non-object", map[string]string{"tenant": "acme"}, `{"order":"PO-1"}`, "", ""},
		{"object field", map[string]string{"tenant": "acme"}, `{"order":{"id":{"n":1}}}`, "", `key field ["order" "id"]`},
		{"array field with the attribute absent", nil, `{"order":{"id":["A"]}}`, "", `key field ["order" "id"]`},
		{"payload not one JSON value", map[string]string{"tenant": "acme"}, `{"order":{"id":"A"}}garbage`, "", `key field ["order" "id"]`},
		{"lone surrogate", map[string]string{"tenant": "acme"}, `{"order":{"id":"A\ud800"}}`, "", `key field ["order" "id"]`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			key, err := tenantAndOrder(compositeEvent(t, c.attrs, c.payload))
			if c.malformed != "" {
				if !errors.Is(err, idempotency.ErrMalformedEvent) || !strings.Contains(err.Error(), c.malformed) || key != "" {
					t.Fatalf("= %q, %v; want ErrMalformedEvent naming %s", key, err, c.malformed)
				}
				return
			}
			if err != nil || key != c.key {
				t.Fatalf("= %q, %v; want %q", key, err, c.key)
			}
		})
	}
}

// Two tuples that a plain join would make one key are two keys; so are
// tuples that differ only in where an escape falls.
func TestCompositeKeyKeepsTuplesApart(t *testing.T) {
	three := idempotency.CompositeKey(idempotency.AttributePart("a"), idempotency.AttributePart("b"), idempotency.AttributePart("c"))
	tuples := [][3]string{
		{"a|b", "c", "d"}, {"a", "b|c", "d"}, {"a", "b", "c|d"},
		{`a\`, "b", "c"}, {"a", `\b`, "c"}, {`a\|b`, "c", "d"}, {`a\`, `|b`, "c"},
		{"a", "b", "c"}, {"a ", "b", "c"}, {"ab", "c", "d"},
	}
	seen := map[string][3]string{}
	for _, tu := range tuples {
		key, err := three(compositeEvent(t, map[string]string{"a": tu[0], "b": tu[1], "c": tu[2]}, `{}`))
		if err != nil || key == "" {
			t.Fatalf("%q: %q, %v", tu, key, err)
		}
		if other, ok := seen[key]; ok {
			t.Fatalf("%q and %q share the key %q", tu, other, key)
		}
		seen[key] = tu
	}
}

// CompositeKey through Idempotent: an unkeyed event is a 400 ErrNoKey (or
// runs unguarded with AllowUnguarded), a malformed part a 400
// ErrMalformedEvent naming the part, both through the functions framework
// and PushHandler; a key over store.MaxKeyLen is refused as the single
// KeyFuncs' are, and stored hashed with WithHashedKeys.
func TestCompositeKeyThroughIdempotent(t *testing.T) {
	ran := func(context.Context, cloudevents.Event) error { t.Error("the handler ran"); return nil }
	opts := []idempotency.Option{idempotency.WithKey(tenantAndOrder), idempotency.WithLogger(newDiscard())}
	for _, c := range []struct {
		name    string
		attrs   map[string]string
		payload string
		want    error
		names   string
	}{
		{"unkeyed", nil, `{"order":{"id":"PO-1"}}`, idempotency.ErrNoKey, ""},
		{"malformed part", map[string]string{"tenant": "acme"}, `{"order":{"id":[1]}}`, idempotency.ErrMalformedEvent, `key field ["order" "id"]`},
		{"over MaxKeyLen", map[string]string{"tenant": strings.Repeat("t", store.MaxKeyLen)}, `{"order":{"id":"PO-1"}}`, store.ErrInvalidKey, "WithHashedKeys"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := compositeEvent(t, c.attrs, c.payload)
			serve(t, idempotency.Idempotent(untouchable(t), opts...)(ran))
			if code := postEvent(t, serverURL, e); code != http.StatusBadRequest {
				t.Fatalf("framework: HTTP %d, want 400", code)
			}
			if err := returned(); !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.names) {
				t.Fatalf("framework: %v; want %v naming %q", err, c.want, c.names)
			}
			srv := httptest.NewServer(idempotency.PushHandler(untouchable(t), ran, opts...))
			defer srv.Close()
			resp, err := http.Post(srv.URL, "application/json", strings.NewReader(string(e.Data())))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusBadRequest {
				t.Fatalf("PushHandler: HTTP %d, want 400", resp.StatusCode)
			}
		})
	}

	t.Run("unguarded", func(t *testing.T) {
		h := &counting{}
		fn := idempotency.Idempotent(untouchable(t), append(opts, idempotency.AllowUnguarded())...)(h.handle)
		if err := fn(context.Background(), compositeEvent(t, map[string]string{"tenant": ""}, `{"order":{"id":"PO-1"}}`)); err != nil || h.runs() != 1 {
			t.Fatalf("= %v after %d runs; want an unguarded run", err, h.runs())
		}
	})

	t.Run("hashed", func(t *testing.T) {
		s, _ := newStore(t)
		h := &counting{}
		long := strings.Repeat("t", store.MaxKeyLen)
		fn := idempotency.Idempotent(s, append(opts, idempotency.WithHashedKeys())...)(h.handle)
		e := compositeEvent(t, map[string]string{"tenant": long}, `{"order":{"id":"PO-1"}}`)
		for range 2 {
			if err := fn(context.Background(), e); err != nil {
				t.Fatal(err)
			}
		}
		if h.runs() != 1 {
			t.Fatalf("%d runs, want 1", h.runs())
		}
		if rec, ok := s.Record(sha256Key(long + "|PO-1")); !ok || rec.State != store.Done {
			t.Fatalf("no done record under the hash of the joined key: %+v, %v", rec, ok)
		}
	})
}

// CompositeKey panics without parts: a key of nothing would make every
// event one duplicate.
func TestCompositeKeyWithoutPartsPanics(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("no panic")
		}
	}()
	idempotency.CompositeKey()
}
