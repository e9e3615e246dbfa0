package idempotency_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"reflect"
	"regexp"
	"strings"
	"testing"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
)

var qtyAndPrice = idempotency.JSONFieldsFingerprint([]string{"order", "qty"}, []string{"order", "price"})

func fieldsFP(t *testing.T, fp idempotency.FingerprintFunc, payload string) (string, error) {
	t.Helper()
	return fp(compositeEvent(t, nil, payload))
}

// JSONFieldsFingerprint reads the chosen fields for what they mean: white
// space, member order, repeated names and string escapes do not count;
// fields not chosen do not count; any change of a chosen field does.
func TestJSONFieldsFingerprintComparesTheChosenFields(t *testing.T) {
	base := `{"order":{"id":"PO-1","qty":3,"price":{"amount":"9.50","currency":"EUR"},"sent":"10:00"}}`
	same := []string{
		base,
		`{"order":{"sent":"11:00","price":{"currency":"EUR","amount":"9.50"},"qty":3,"id":"PO-1"}}`,
		"{ \"order\" : {\n \"qty\" : 3 ,\t\"price\":{ \"currency\" : \"\\u0045UR\", \"amount\":\"9.50\" } } , \"note\":1}",
		`{"order":{"qty":2,"qty":3,"price":{"amount":"9.50","currency":"EUR"}}}`,
	}
	different := []string{
		`{"order":{"id":"PO-1","qty":4,"price":{"amount":"9.50","currency":"EUR"}}}`,
		`{"order":{"id":"PO-1","qty":3.0,"price":{"amount":"9.50","currency":"EUR"}}}`,
		`{"order":{"id":"PO-1","qty":"3","price":{"amount":"9.50","currency":"EUR"}}}`,
		`{"order":{"id":"PO-1","qty":3,"price":{"amount":"9.50","currency":"USD"}}}`,
		`{"order":{"id":"PO-1","qty":3,"price":{"amount":"9.50","currency":"EUR","tax":0}}}`,
		`{"order":{"id":"PO-1","qty":3,"price":{"amount":"9.50"}}}`,
		`{"order":{"id":"PO-1","qty":3,"price":["9.50","EUR"]}}`,
		`{"order":{"id":"PO-1","qty":3,"price":["EUR","9.50"]}}`,
		`{"order":{"id":"PO-1","qty":3,"price":null}}`,
		`{"order":{"id":"PO-1","qty":3}}`,
		`{"order":{"id":"PO-1","qty":null}}`,
		`{"order":{"id":"PO-1"}}`,
		`{"order":{"id":"PO-1","qty":true,"price":{"amount":"9.50","currency":"EUR"}}}`,
		`{"order":{"id":"PO-1","qty":3,"price":{"amount":"9.5","currency":"EUR"}}}`,
	}
	want, err := fieldsFP(t, qtyAndPrice, base)
	if err != nil || !regexp.MustCompile(`^fields-sha256\.[0-9a-f]{8}:[0-9a-f]{32}$`).MatchString(want) {
		t.Fatalf("= %q, %v; want fields-sha256.<8 hex>:<32 hex>", want, err)
	}
	for _, p := range same {
		if got, err := fieldsFP(t, qtyAndPrice, p); err != nil || got != want {
			t.Errorf("%s: %q, %v; want %q", p, got, err, want)
		}
	}
	seen := map[string]string{want: base}
	for _, p := range different {
		got, err := fieldsFP(t, qtyAndPrice, p)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if other, ok := seen[got]; ok {
			t.Errorf("%s and %s share the fingerprint %q", p, other, got)
		}
		seen[got] = p
	}

	// Absent everywhere: a path through a non-object reads nothing.
	absent, _ := fieldsFP(t, qtyAndPrice, `{"order":{"id":"PO-1"}}`)
	for _, p := range []string{`{"order":"PO-1"}`, `[]`, `{}`} {
		if got, err := fieldsFP(t, qtyAndPrice, p); err != nil || got != absent {
			t.Errorf("%s: %q, %v; want %q, as with both fields absent", p, got, err, absent)
		}
	}

	// The scheme names the set of paths, in any order.
	swapped := idempotency.JSONFieldsFingerprint([]string{"order", "price"}, []string{"order", "qty"}, []string{"order", "qty"})
	if got, _ := fieldsFP(t, swapped, same[1]); got != want {
		t.Errorf("paths in another order: %q, want %q", got, want)
	}
	other, _ := fieldsFP(t, idempotency.JSONFieldsFingerprint([]string{"order", "qty"}), base)
	otherPath, _ := fieldsFP(t, idempotency.JSONFieldsFingerprint([]string{"order", "qtyprice"}), base)
	if scheme(other) == scheme(want) || scheme(other) == scheme(otherPath) {
		t.Errorf("one scheme for other paths: %q, %q, %q", want, other, otherPath)
	}
	if data, _ := idempotency.PayloadFingerprint()(compositeEvent(t, nil, base)); scheme(data) == scheme(want) {
		t.Errorf("the data's scheme %q is the fields' %q", data, want)
	}
}

func scheme(fp string) string { return fp[:strings.LastIndexByte(fp, ':')] }

// A payload that is not one JSON value, and a chosen field with a string
// (a member name included) that is not UTF-8 or has a lone surrogate, are
// the message's fault: ErrMalformedEvent naming the field. Data that is no
// Pub/Sub envelope has no fingerprint.
func TestJSONFieldsFingerprintRefusesWhatItCannotRead(t *testing.T) {
	for _, p := range []string{
		`{"order":{"qty":3}}garbage`,
		`not JSON`,
		"{\"order\":{\"qty\":\"3\xff\"}}",
		`{"order":{"price":{"cur\udc00":"EUR"}}}`,
		`{"order":{"price":["\ud800"]}}`,
	} {
		_, err := fieldsFP(t, qtyAndPrice, p)
		if !errors.Is(err, idempotency.ErrMalformedEvent) || !strings.Contains(err.Error(), `fingerprint field ["order"`) {
			t.Errorf("%q: %v; want ErrMalformedEvent naming the field", p, err)
		}
	}
	e := cloudevents.NewEvent()
	e.SetID("1")
	e.SetType("com.example.other")
	e.SetSource("s")
	_ = e.SetData(cloudevents.ApplicationJSON, map[string]any{"order": map[string]any{"qty": 3}})
	if fp, err := qtyAndPrice(e); fp != "" || err != nil {
		t.Errorf("not an envelope: %q, %v; want none", fp, err)
	}
}

// Through Idempotent: a redelivery of the key whose chosen fields changed
// is a 409 payload mismatch; one whose other fields changed is a
// duplicate.
func TestJSONFieldsFingerprintThroughIdempotent(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s, idempotency.WithKey(tenantAndOrder), idempotency.WithLogger(newDiscard()),
		idempotency.WithFingerprint(qtyAndPrice))(h.handle))
	tenant := map[string]string{"tenant": "acme"}
	for _, c := range []struct {
		payload string
		code    int
	}{
		{`{"order":{"id":"PO-1","qty":3,"sent":"10:00"}}`, http.StatusOK},
		{`{"order":{"sent":"10:05","qty":3,"id":"PO-1"}}`, http.StatusOK},
		{`{"order":{"id":"PO-1","qty":999,"sent":"10:06"}}`, http.StatusConflict},
	} {
		if code := postEvent(t, serverURL, compositeEvent(t, tenant, c.payload)); code != c.code {
			t.Fatalf("%s: HTTP %d, want %d", c.payload, code, c.code)
		}
	}
	if h.runs() != 1 {
		t.Fatalf("%d runs, want 1", h.runs())
	}
	if err := returned(); !errors.Is(err, idempotency.ErrPayloadMismatch) {
		t.Fatalf("%v, want ErrPayloadMismatch", err)
	}
}

// JSONFieldsFingerprint panics without paths.
func TestJSONFieldsFingerprintWithoutPathsPanics(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("no panic")
		}
	}()
	idempotency.JSONFieldsFingerprint()
}

// FuzzJSONFieldsFingerprint: two JSON values of the chosen field have one
// fingerprint exactly when encoding/json decodes them (numbers as written)
// to equal values; and the fingerprint of a value re-encoded in another
// layout is the same.
func FuzzJSONFieldsFingerprint(f *testing.F) {
	f.Add([]byte(`{"a":1,"b":[true,null,"x"]}`), []byte(`{"b":[true,null,"x"],"a":1}`))
	f.Add([]byte(`"\u0041"`), []byte(`"A"`))
	f.Add([]byte(`1`), []byte(`1.0`))
	f.Add([]byte(`{"a":1,"a":2}`), []byte(`{"a":2}`))
	fp := idempotency.JSONFieldsFingerprint([]string{"f"})
	f.Fuzz(func(t *testing.T, a, b []byte) {
		if !json.Valid(a) || !json.Valid(b) {
			return
		}
		fingerprint := func(v []byte) (string, error) {
			data := append(append([]byte(`{"f":`), v...), '}')
			return fp(newEventOfPayload(data))
		}
		decode := func(v []byte) any {
			d := json.NewDecoder(bytes.NewReader(v))
			d.UseNumber()
			var x any
			if err := d.Decode(&x); err != nil {
				t.Fatal(err)
			}
			return x
		}
		fa, errA := fingerprint(a)
		fb, errB := fingerprint(b)
		if errA != nil || errB != nil {
			for _, err := range []error{errA, errB} {
				if err != nil && !errors.Is(err, idempotency.ErrMalformedEvent) {
					t.Fatal(err)
				}
			}
			return // a string that is not UTF-8, or a lone surrogate
		}
		va, vb := decode(a), decode(b)
		if (fa == fb) != reflect.DeepEqual(va, vb) {
			t.Fatalf("%s -> %s, %s -> %s; decoded %#v, %#v", a, fa, b, fb, va, vb)
		}
		re, err := json.MarshalIndent(va, " ", "\t")
		if err != nil {
			t.Fatal(err)
		}
		if fr, err := fingerprint(re); err != nil || fr != fa {
			t.Fatalf("%s -> %s, re-encoded %s -> %s, %v", a, fa, re, fr, err)
		}
	})
}

// newEventOfPayload is a Pub/Sub CloudEvent whose message data is payload.
func newEventOfPayload(payload []byte) cloudevents.Event {
	e := cloudevents.NewEvent()
	e.SetID("1")
	e.SetType(idempotency.PubSubEventType)
	e.SetSource("//pubsub.googleapis.com/projects/p/topics/t")
	_ = e.SetData(cloudevents.ApplicationJSON, map[string]any{"message": map[string]any{"messageId": "1", "data": payload}})
	return e
}
