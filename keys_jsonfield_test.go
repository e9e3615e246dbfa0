package idempotency_test

import (
	"context"
	"encoding/base64"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
)

// dataEvent is a Pub/Sub CloudEvent of message id whose data is payload,
// byte for byte.
func dataEvent(t *testing.T, id, payload string) cloudevents.Event {
	t.Helper()
	return pubsubEvent(t, id, map[string]any{"messageId": id, "data": base64.StdEncoding.EncodeToString([]byte(payload))})
}

// unusableKeyFields are payloads from which JSONField("order", "id")
// cannot take a key, though they are not unkeyed: the message is at fault.
var unusableKeyFields = []struct{ name, payload string }{
	{"object", `{"order":{"id":{"n":1}}}`},
	{"array", `{"order":{"id":["A"]}}`},
	{"empty array", `{"order":{"id":[]}}`},
	{"trailing garbage", `{"order":{"id":"A"}}garbage`},
	{"two values", `{"order":{"id":"A"}}{"order":{"id":"B"}}`},
	{"trailing bracket", `{"order":{"id":"A"}}]`},
	{"invalid UTF-8", "{\"order\":{\"id\":\"A\xffB\"}}"},
	{"encoded surrogate", "{\"order\":{\"id\":\"A\xed\xa0\x80\"}}"},
	{"lone high surrogate", `{"order":{"id":"A\ud800B"}}`},
	{"lone low surrogate", `{"order":{"id":"A\udc00"}}`},
	{"high surrogate before a non-surrogate", `{"order":{"id":"\ud800\u0041"}}`},
	{"high surrogate last", `{"order":{"id":"A\uD83D"}}`},
}

// A business-key field that is an object or an array, a payload that is
// not exactly one JSON value, and a key string with invalid UTF-8 or a
// lone surrogate are the message's fault: through the functions
// framework and through PushHandler, a 400 (nack) that names the field,
// wrapping ErrMalformedEvent; the handler does not run and the backend is
// never called. (The object and the array were a 500; the trailing data
// and the bad strings were keyed, "A" or U+FFFD, and ran.)
func TestJSONFieldRefusesUnusableFieldsAs400NamingTheField(t *testing.T) {
	opts := func() []idempotency.Option {
		return []idempotency.Option{idempotency.WithKey(idempotency.JSONField("order", "id")), idempotency.WithLogger(newDiscard())}
	}
	ran := func(context.Context, cloudevents.Event) error { t.Error("the handler ran"); return nil }
	for _, c := range unusableKeyFields {
		t.Run(c.name, func(t *testing.T) {
			e := dataEvent(t, "m-1", c.payload)

			serve(t, idempotency.Idempotent(untouchable(t), opts()...)(ran))
			if code := postEvent(t, serverURL, e); code != http.StatusBadRequest {
				t.Fatalf("framework: HTTP %d, want 400", code)
			}
			err := returned()
			if !errors.Is(err, idempotency.ErrMalformedEvent) || !strings.Contains(err.Error(), `key field ["order" "id"]`) {
				t.Fatalf("framework: %v; want ErrMalformedEvent naming the field", err)
			}

			srv := httptest.NewServer(idempotency.PushHandler(untouchable(t), ran, opts()...))
			defer srv.Close()
			for _, post := range []func() (*http.Response, error){
				func() (*http.Response, error) { // binary CloudEvent
					req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(string(e.Data())))
					for k, v := range map[string]string{"Content-Type": "application/json", "Ce-Id": e.ID(), "Ce-Source": e.Source(),
						"Ce-Specversion": "1.0", "Ce-Type": e.Type()} {
						req.Header.Set(k, v)
					}
					return http.DefaultClient.Do(req)
				},
				func() (*http.Response, error) { // raw push envelope
					return http.Post(srv.URL, "application/json", strings.NewReader(string(e.Data())))
				},
			} {
				resp, err := post()
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), `key field [\"order\" \"id\"]`) &&
					!strings.Contains(string(body), `key field ["order" "id"]`) {
					t.Fatalf("PushHandler: HTTP %d %q; want 400 naming the field", resp.StatusCode, body)
				}
			}
		})
	}
}

// A business key is the field's exact JSON value, type included: "1" and
// 1, "true" and true, 1 and 1.0 are different keys, each message runs
// once under its own record, and a plain string keeps the key bytes it
// always had (so records stored before keep deduplicating).
func TestJSONFieldKeysTheExactJSONValue(t *testing.T) {
	s, _ := newStore(t)
	cnt := &counting{}
	h := idempotency.Idempotent(s, idempotency.WithKey(idempotency.JSONField("id")), idempotency.WithKeyPrefix("orders:"),
		idempotency.WithLogger(newDiscard()), idempotency.WithFingerprint(nil))(cnt.handle)
	payloads := []string{
		`{"id":"1"}`, `{"id":1}`, `{"id":1.0}`, `{"id":"true"}`, `{"id":true}`, `{"id":"false"}`, `{"id":false}`,
		`{"id":"json:1"}`, `{"id":"A"}`, `{"id":"\ud83d\ude00"}`, `{"id":"\ufffd"}`,
	}
	for round := range 2 {
		for i, p := range payloads {
			if err := h(t.Context(), dataEvent(t, "m-"+string(rune('a'+i))+"-"+string(rune('0'+round)), p)); err != nil {
				t.Fatalf("%s: %v", p, err)
			}
		}
	}
	if cnt.runs() != len(payloads) || s.Len() != len(payloads) {
		t.Fatalf("runs %d, records %d; want %d of each (each value its own key, the second round duplicates)", cnt.runs(), s.Len(), len(payloads))
	}
	for _, stored := range []string{"orders:A", "orders:1", "orders:true", "orders:\U0001F600", "orders:\ufffd"} {
		if _, ok := s.Record(stored); !ok {
			t.Errorf("no record %q: a string key must keep its bytes", stored)
		}
	}
}

// The keys JSONField gives each kind of value (unit level): strings as
// they are, other scalars behind "json:" in their exact JSON spelling, a
// string that itself starts with "json:" as "json:" and its JSON text, so
// that no two values share a key; and the refusals name the field.
func TestJSONFieldKeyOfEachValue(t *testing.T) {
	for _, c := range []struct{ payload, want string }{
		{`{"id":"A"}`, "A"},
		{`{"id":"1"}`, "1"},
		{`{"id":1}`, "json:1"},
		{`{"id":-1.50e+3}`, "json:-1.50e+3"},
		{`{"id":12345678901234567890}`, "json:12345678901234567890"},
		{`{"id":true}`, "json:true"},
		{`{"id":false}`, "json:false"},
		{`{"id":"true"}`, "true"},
		{`{"id":"json:1"}`, `json:"json:1"`},
		{`{"id":"json:<a>"}`, `json:"json:<a>"`},
		{`{"id":"a\"b"}`, `a"b`},
		{`{"id":"\u00e9"}`, "é"},
		{`{"id":"\ud83d\ude00"}`, "\U0001F600"},
		{` {"id" : "ws"} ` + "\n", "ws"},
		{`{"id":null}`, ""},
		{`{}`, ""},
		{`{"id":"A","id":"B"}`, "B"},
		{`"just a string"`, ""},
		{`null`, ""},
	} {
		got, err := idempotency.JSONField("id")(dataEvent(t, "m", c.payload))
		if err != nil || got != c.want {
			t.Errorf("payload %s: key %q, %v; want %q", c.payload, got, err, c.want)
		}
	}
	for _, c := range unusableKeyFields {
		_, err := idempotency.JSONField("order", "id")(dataEvent(t, "m", c.payload))
		if !errors.Is(err, idempotency.ErrMalformedEvent) || !strings.Contains(err.Error(), `key field ["order" "id"]`) {
			t.Errorf("%s: %v; want ErrMalformedEvent naming the field", c.name, err)
		}
	}
}
