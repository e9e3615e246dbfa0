package idempotency_test

import (
	"encoding/base64"
	"errors"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency"
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
		{[]string{"order", "n"}, "12345678901234567", false}, // no float rounding
		{[]string{"order", "paid"}, "true", false},
		{[]string{"order", "none"}, "", false},
		{[]string{"order", "absent"}, "", false},
		{[]string{"order", "id", "deeper"}, "", false},
		{[]string{"order", "lines"}, "", true},
		{[]string{"order"}, "", true},
	}
	for _, c := range cases {
		got, err := idempotency.JSONField(c.path...)(e)
		if got != c.want || (err != nil) != c.wantErr {
			t.Errorf("JSONField(%q) = %q, %v; want %q, error %v", c.path, got, err, c.want, c.wantErr)
		}
	}
	notJSON := pubsubEvent(t, "2", map[string]any{"messageId": "2", "data": base64.StdEncoding.EncodeToString([]byte("<xml/>"))})
	if _, err := idempotency.JSONField("id")(notJSON); !errors.Is(err, idempotency.ErrMalformedEvent) {
		t.Fatalf("non-JSON payload: %v, want ErrMalformedEvent", err)
	}
}
