package idempotency_test

import (
	"context"
	"strings"
	"testing"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
)

// Key prefixes that are prefixes of each other would share keys
// ("orders:" + "refunds:1" == "orders:refunds:" + "1"): WithKeyPrefix
// refuses them, and the prefixes it accepts never compose the same key.
func TestKeyPrefixesThatArePrefixesOfEachOtherAreRefused(t *testing.T) {
	s, _ := newStore(t)
	for _, p := range []string{"orders:refunds:", "orders", ":", "::", "a:b", "orders::", "orders:\x00"} {
		t.Run(p, func(t *testing.T) {
			defer func() {
				msg, _ := recover().(string)
				if !strings.HasPrefix(msg, "idempotency.Idempotent: key prefix: ") {
					t.Fatalf("WithKeyPrefix(%q): panic %q, want a refusal", p, msg)
				}
			}()
			idempotency.Idempotent(s, idempotency.WithKeyPrefix(p))
		})
	}
	// Accepted prefixes keep their handlers apart even when a key looks
	// like another prefix.
	runs := map[string]int{}
	handler := func(name string) idempotency.CloudEventFunc {
		return func(context.Context, cloudevents.Event) error { runs[name]++; return nil }
	}
	byAttr := idempotency.WithKey(idempotency.Attribute("k"))
	orders := idempotency.Idempotent(s, byAttr, idempotency.WithKeyPrefix("orders:"))(handler("orders"))
	refunds := idempotency.Idempotent(s, byAttr, idempotency.WithKeyPrefix("orders.refunds:"))(handler("refunds"))
	ev := func(id, k string) cloudevents.Event {
		return pubsubEvent(t, id, map[string]any{"messageId": id, "attributes": map[string]string{"k": k}})
	}
	if err := orders(t.Context(), ev("1", "refunds:1")); err != nil {
		t.Fatal(err)
	}
	if err := refunds(t.Context(), ev("2", "1")); err != nil {
		t.Fatal(err)
	}
	if err := orders(t.Context(), ev("3", "orders.refunds:1")); err != nil {
		t.Fatal(err)
	}
	if runs["orders"] != 2 || runs["refunds"] != 1 || s.Len() != 3 {
		t.Fatalf("runs %v, records %d; want every handler to run once per distinct key", runs, s.Len())
	}
}

// A key the port refuses (NUL byte, or pushed past MaxKeyLen by the
// prefix) is an error before the backend is called; a key of exactly
// MaxKeyLen bytes, or one that is not UTF-8, is a key like any other.
func TestKeysThePortRefusesNeverReachTheBackend(t *testing.T) {
	long := strings.Repeat("k", 1024)
	for name, key := range map[string]string{"NUL": "a\x00b", "over MaxKeyLen with the prefix": long[:1020]} {
		t.Run(name, func(t *testing.T) {
			h := idempotency.Idempotent(untouchable(t), idempotency.WithKeyPrefix("orders:"),
				idempotency.WithKey(func(cloudevents.Event) (string, error) { return key, nil }))(
				func(context.Context, cloudevents.Event) error { t.Error("handler ran"); return nil })
			if err := h(t.Context(), pubsubEvent(t, "m", map[string]any{"messageId": "m"})); err == nil {
				t.Fatal("accepted a key the port refuses")
			}
		})
	}
	for name, key := range map[string]string{"1 KiB": long, "not UTF-8": "\xff\xfe\x80"} {
		t.Run(name, func(t *testing.T) {
			s, _ := newStore(t)
			runs := 0
			h := idempotency.Idempotent(s, idempotency.WithKey(func(cloudevents.Event) (string, error) { return key, nil }))(
				func(context.Context, cloudevents.Event) error { runs++; return nil })
			e := pubsubEvent(t, "m", map[string]any{"messageId": "m"})
			if err := h(t.Context(), e); err != nil {
				t.Fatal(err)
			}
			if err := h(t.Context(), e); err != nil || runs != 1 {
				t.Fatalf("redelivery: %v, runs %d; want an ack and one run", err, runs)
			}
			if _, ok := s.Record(key); !ok {
				t.Fatal("no record under the exact key")
			}
		})
	}
}
