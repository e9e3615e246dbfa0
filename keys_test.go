package idempotency_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

func TestMessageIDResolutionOrder(t *testing.T) {
	key := idempotency.MessageID()
	cases := []struct {
		name    string
		typ     string
		message map[string]any
		want    string
	}{
		{"messageId first", idempotency.PubSubEventType, map[string]any{"messageId": "a", "message_id": "b"}, "a"},
		{"then message_id", idempotency.PubSubEventType, map[string]any{"message_id": "b"}, "b"},
		{"then the CloudEvent id for a Pub/Sub event", idempotency.PubSubEventType, map[string]any{}, "ce-id"},
		{"no fallback for another type", "com.example.v1", map[string]any{}, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := pubsubEvent(t, "ce-id", c.message)
			e.SetType(c.typ)
			got, err := key(e)
			if err != nil || got != c.want {
				t.Fatalf("key = %q, %v; want %q", got, err, c.want)
			}
		})
	}
}

// EventID keys any event by its source and id, joined as CompositeKey
// joins its parts; DefaultKey is MessageID for a Pub/Sub message and
// EventID for any other event. Neither keys an event without an id, nor
// PushHandler's event of a push without a message id (whose id is a
// placeholder shared by every such push: keyed by it, they would all be
// one key, and every one after the first acked unrun).
func TestEventIDAndDefaultKey(t *testing.T) {
	ev := func(typ, source, id string) cloudevents.Event {
		e := pubsubEvent(t, "x", map[string]any{"messageId": "m-1"})
		e.SetType(typ)
		e.SetSource(source)
		e.SetID(id)
		return e
	}
	const storage = "google.cloud.storage.object.v1.finalized"
	for _, c := range []struct {
		name              string
		e                 cloudevents.Event
		eventID, defaultK string
	}{
		{"a Cloud Storage event", ev(storage, "//storage.googleapis.com/projects/_/buckets/b", "123"),
			"//storage.googleapis.com/projects/_/buckets/b|123", "//storage.googleapis.com/projects/_/buckets/b|123"},
		{"a Pub/Sub message: DefaultKey takes its messageId", ev(idempotency.PubSubEventType, "//pubsub.googleapis.com/projects/p/topics/t", "ce-1"),
			"//pubsub.googleapis.com/projects/p/topics/t|ce-1", "m-1"},
		{"the SDK's form of the source (a URI reference, percent-encoded)", ev(storage, "a|b", "c"), "a%7Cb|c", "a%7Cb|c"},
		{"a separator in the id", ev(storage, "a", "b|c"), `a|b\|c`, `a|b\|c`},
		{"a backslash in the id", ev(storage, "a", `b\`), `a|b\\`, `a|b\\`},
		{"PushHandler's placeholder for a push without a message id", ev("io.github.gcp-pubsub-idempotency.push.unidentified", "//pubsub.googleapis.com/s", "unidentified"), "", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			if k, err := idempotency.EventID()(c.e); err != nil || k != c.eventID {
				t.Fatalf("EventID = %q, %v; want %q", k, err, c.eventID)
			}
			if k, err := idempotency.DefaultKey()(c.e); err != nil || k != c.defaultK {
				t.Fatalf("DefaultKey = %q, %v; want %q", k, err, c.defaultK)
			}
		})
	}
	// A source and id too long for the port: refused as the other
	// KeyFuncs refuse theirs, and stored hashed with WithHashedKeys.
	long := ev(storage, "//storage.googleapis.com/"+strings.Repeat("b", store.MaxKeyLen), "1")
	if _, err := idempotency.EventID()(long); !errors.Is(err, store.ErrInvalidKey) || !strings.Contains(err.Error(), "WithHashedKeys") {
		t.Fatalf("EventID of an overlong source = %v, want ErrInvalidKey naming WithHashedKeys", err)
	}
}

func TestAttributeKey(t *testing.T) {
	e := pubsubEvent(t, "1", map[string]any{"messageId": "1", "attributes": map[string]string{"po_id": "PO-7"}})
	if k, err := idempotency.Attribute("po_id")(e); k != "PO-7" || err != nil {
		t.Fatalf("Attribute(po_id) = %q, %v", k, err)
	}
	if k, err := idempotency.Attribute("missing")(e); k != "" || err != nil {
		t.Fatalf("Attribute(missing) = %q, %v; want unkeyed", k, err)
	}
}

func TestJSONFieldKey(t *testing.T) {
	e := pubsubEvent(t, "1", map[string]any{"messageId": "1", "data": payload(map[string]any{
		"order": map[string]any{"id": "PO-9", "n": 12345678901234567, "paid": true, "none": nil, "lines": []int{1}},
	})})
	cases := []struct {
		path    []string
		want    string
		wantErr bool
	}{
		{[]string{"order", "id"}, "PO-9", false},
		{[]string{"order", "n"}, "json:12345678901234567", false}, // no float rounding; not the string "12345678901234567"
		{[]string{"order", "paid"}, "json:true", false},
		{[]string{"order", "none"}, "", false},
		{[]string{"order", "absent"}, "", false},
		{[]string{"order", "id", "deeper"}, "", false},
		{[]string{"order", "lines"}, "", true},
		{[]string{"order"}, "", true},
	}
	for _, c := range cases {
		got, err := idempotency.JSONField(c.path...)(e)
		if got != c.want || (err != nil) != c.wantErr || err != nil && !errors.Is(err, idempotency.ErrMalformedEvent) {
			t.Errorf("JSONField(%q) = %q, %v; want %q, error (ErrMalformedEvent) %v", c.path, got, err, c.want, c.wantErr)
		}
	}
	notJSON := pubsubEvent(t, "2", map[string]any{"messageId": "2", "data": base64.StdEncoding.EncodeToString([]byte("<xml/>"))})
	if _, err := idempotency.JSONField("id")(notJSON); !errors.Is(err, idempotency.ErrMalformedEvent) {
		t.Fatalf("non-JSON payload: %v, want ErrMalformedEvent", err)
	}
}

// postEvent posts e in binary CloudEvents mode to the server at url and
// returns the status.
func postEvent(t testing.TB, url string, e cloudevents.Event) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+"/", bytes.NewReader(e.Data()))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{"Content-Type": "application/json", "Ce-Id": e.ID(), "Ce-Source": e.Source(),
		"Ce-Specversion": "1.0", "Ce-Type": e.Type()} {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

func sha256Key(key string) string {
	sum := sha256.Sum256([]byte(key))
	return idempotency.HashedKeyPrefix + hex.EncodeToString(sum[:])
}

// With WithHashedKeys, keys the port refuses (over MaxKeyLen, a NUL byte)
// are stored as "sha256:" + hex behind the prefix, through the framework
// and PushHandler: the delivery runs once and its redelivery is a
// duplicate. Without it they are a 400. Storable keys keep their
// spelling, except one that starts with "sha256:", which is hashed so it
// cannot meet another key's hash.
func TestHashedKeysStoreKeysThePortRefuses(t *testing.T) {
	long := strings.Repeat("k", store.MaxKeyLen+1)
	for _, c := range []struct {
		name, key, stored string
		storable          bool // without WithHashedKeys
	}{
		{"over MaxKeyLen", long, "orders:" + sha256Key(long), false},
		{"over MaxKeyLen with the prefix", long[:1020], "orders:" + sha256Key(long[:1020]), false},
		{"NUL", "a\x00b", "orders:" + sha256Key("a\x00b"), false},
		{"storable", "PO-1", "orders:PO-1", true},
		{"looks hashed", sha256Key(long), "orders:" + sha256Key(sha256Key(long)), true},
	} {
		for _, hashed := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/hashed=%v", c.name, hashed), func(t *testing.T) {
				e := pubsubEvent(t, "m-1", map[string]any{"messageId": "m-1", "attributes": map[string]string{"k": c.key}})
				want, wantRuns, stored := http.StatusOK, 1, c.stored
				if !hashed {
					stored = "orders:" + c.key
					if !c.storable {
						want, wantRuns = http.StatusBadRequest, 0
					}
				}
				for _, path := range []string{"framework", "PushHandler"} {
					s, _ := newStore(t)
					cnt := &counting{}
					opts := []idempotency.Option{idempotency.WithKey(idempotency.Attribute("k")), idempotency.WithKeyPrefix("orders:"),
						idempotency.WithLogger(newDiscard())}
					if hashed {
						opts = append(opts, idempotency.WithHashedKeys())
					}
					url, ack := serverURL, http.StatusOK
					if path == "framework" {
						serve(t, idempotency.Idempotent(s, opts...)(cnt.handle))
					} else {
						srv := httptest.NewServer(idempotency.PushHandler(s, cnt.handle, opts...))
						defer srv.Close()
						url, ack = srv.URL, http.StatusNoContent
					}
					w := want
					if w == http.StatusOK {
						w = ack
					}
					for range 2 {
						if code := postEvent(t, url, e); code != w {
							t.Fatalf("%s: HTTP %d, want %d", path, code, w)
						}
					}
					if cnt.runs() != wantRuns {
						t.Fatalf("%s: %d runs, want %d", path, cnt.runs(), wantRuns)
					}
					if rec, ok := s.Record(stored); wantRuns == 1 && (!ok || rec.State != store.Done || s.Len() != 1) {
						t.Fatalf("%s: record %q = %+v (present %v), %d records; want it done, alone", path, stored, rec, ok, s.Len())
					}
				}
			})
		}
	}
}

// A key that looks like the hash of another is never stored as that
// hash: both run, under two records. A KeyFunc's own error is no key and
// still nacks; a prefix too long for a hashed key is a 400 that says so.
func TestHashedKeysNeverMeetAPlainKey(t *testing.T) {
	s, _ := newStore(t)
	runs := 0
	key := ""
	h := idempotency.Idempotent(s, idempotency.WithHashedKeys(), idempotency.WithLogger(newDiscard()),
		idempotency.WithKey(func(cloudevents.Event) (string, error) { return key, nil }))(
		func(context.Context, cloudevents.Event) error { runs++; return nil })
	long := strings.Repeat("x", 2000)
	for i, k := range []string{long, sha256Key(long), long, sha256Key(long)} {
		key = k
		if err := h(t.Context(), pubsubEvent(t, fmt.Sprint(i), map[string]any{"messageId": fmt.Sprint(i)})); err != nil {
			t.Fatal(err)
		}
	}
	if runs != 2 || s.Len() != 2 {
		t.Fatalf("runs %d, records %d; want 2 and 2", runs, s.Len())
	}

	own := idempotency.Idempotent(s, idempotency.WithHashedKeys(), idempotency.WithLogger(newDiscard()),
		idempotency.WithKey(func(cloudevents.Event) (string, error) { return "", fmt.Errorf("lookup: %w", store.ErrInvalidKey) }))(
		func(context.Context, cloudevents.Event) error { t.Error("ran"); return nil })
	if err := own(t.Context(), pubsubEvent(t, "m", map[string]any{"messageId": "m"})); !errors.Is(err, store.ErrInvalidKey) {
		t.Fatalf("a KeyFunc's own error: %v, want it refused", err)
	}
	prefix := strings.Repeat("p", 1000) + ":"
	err := idempotency.Idempotent(s, idempotency.WithHashedKeys(), idempotency.WithKeyPrefix(prefix), idempotency.WithLogger(newDiscard()),
		idempotency.WithKey(func(cloudevents.Event) (string, error) { return long, nil }))(
		func(context.Context, cloudevents.Event) error { t.Error("ran"); return nil })(t.Context(), pubsubEvent(t, "m", map[string]any{"messageId": "m"}))
	if !errors.Is(err, store.ErrInvalidKey) || !strings.Contains(err.Error(), "prefix is too long") {
		t.Fatalf("long prefix: %v", err)
	}
}

// FuzzHashedKeys: under WithHashedKeys two different keys never share a
// record, and every key (but the empty one) is stored.
func FuzzHashedKeys(f *testing.F) {
	long := strings.Repeat("k", store.MaxKeyLen+1)
	f.Add("a", "b")
	f.Add(long, sha256Key(long))
	f.Add(long, "sha256:"+long)
	f.Add("a\x00", sha256Key("a\x00"))
	f.Fuzz(func(t *testing.T, k1, k2 string) {
		if k1 == "" || k2 == "" {
			return
		}
		s := fake.New()
		runs, key := 0, ""
		h := idempotency.Idempotent(s, idempotency.WithHashedKeys(), idempotency.WithKeyPrefix("p:"), idempotency.WithLogger(newDiscard()),
			idempotency.WithKey(func(cloudevents.Event) (string, error) { return key, nil }))(
			func(context.Context, cloudevents.Event) error { runs++; return nil })
		e := cloudevents.NewEvent()
		e.SetID("m")
		e.SetSource("s")
		e.SetType(idempotency.PubSubEventType)
		for _, k := range []string{k1, k2} {
			key = k
			if err := h(t.Context(), e); err != nil {
				t.Fatalf("key %q: %v", k, err)
			}
		}
		want := 2
		if k1 == k2 {
			want = 1
		}
		if runs != want || s.Len() != want {
			t.Fatalf("keys %q, %q: runs %d, records %d; want %d", k1, k2, runs, s.Len(), want)
		}
	})
}

// The refusals of unkeyed, non-Pub/Sub and unstorable events name the
// option that fixes them.
func TestKeyErrorsNameTheOptionThatFixesThem(t *testing.T) {
	byMessageID := []idempotency.Option{idempotency.WithKey(idempotency.MessageID())}
	other := pubsubEvent(t, "e-1", map[string]any{"messageId": "m"})
	other.SetType("com.example.order.v1")
	other.SetData(cloudevents.ApplicationJSON, map[string]any{"order": map[string]any{"id": "PO-1"}})
	otherWithMessage := pubsubEvent(t, "e-2", map[string]any{})
	otherWithMessage.SetType("com.example.order.v1")
	for _, c := range []struct {
		name  string
		e     cloudevents.Event
		opts  []idempotency.Option
		is    error
		names []string
	}{
		{"unkeyed Pub/Sub message", pubsubEvent(t, "m", map[string]any{"messageId": "m"}),
			[]idempotency.Option{idempotency.WithKey(idempotency.Attribute("k"))}, idempotency.ErrNoKey,
			[]string{"WithKey(JSONField(...))", "WithKey(Attribute(...))", "AllowUnguarded"}},
		{"non-Pub/Sub event under MessageID", other, byMessageID, idempotency.ErrMalformedEvent,
			[]string{"not a Pub/Sub message", "WithKey"}},
		{"non-Pub/Sub event with a message object under MessageID", otherWithMessage, byMessageID, idempotency.ErrNoKey,
			[]string{"not a Pub/Sub message", "WithKey(JSONField(...))", "AllowUnguarded"}},
		{"key over MaxKeyLen", pubsubEvent(t, "m", map[string]any{"messageId": strings.Repeat("m", 2000)}), nil,
			store.ErrInvalidKey, []string{"WithHashedKeys"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			serve(t, idempotency.Idempotent(untouchable(t), append(c.opts, idempotency.WithLogger(newDiscard()))...)(
				func(context.Context, cloudevents.Event) error { t.Error("ran"); return nil }))
			if code := postEvent(t, serverURL, c.e); code != http.StatusBadRequest {
				t.Fatalf("HTTP %d, want 400", code)
			}
			err := returned()
			for _, name := range c.names {
				if !errors.Is(err, c.is) || !strings.Contains(err.Error(), name) {
					t.Fatalf("%v: want it to wrap %v and name %s", err, c.is, name)
				}
			}
		})
	}
}
