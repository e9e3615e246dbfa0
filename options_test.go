package idempotency_test

import (
	"context"
	"strings"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
)

func TestHeartbeatMustBeShorterThanTheLease(t *testing.T) {
	s := fake.New()
	noop := func(context.Context) error { return nil }
	for _, hb := range []time.Duration{-time.Second, time.Minute, 2 * time.Minute} {
		if err := idempotency.Lock(t.Context(), s, "k", noop, idempotency.WithLease(time.Minute), idempotency.WithHeartbeat(hb)); err == nil {
			t.Errorf("heartbeat %v with a 1m lease accepted", hb)
		}
	}
}

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
