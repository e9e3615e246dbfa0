package idempotency_test

import (
	"context"
	"fmt"
	"net/http"
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

// An option is a value: one option set, reused across calls and extended
// by one of them, configures each call on its own, before and after.
func TestOptionsAreAppliedAfreshForEachCall(t *testing.T) {
	s, _ := newStore(t)
	ok := func(context.Context, cloudevents.Event) error { return nil }
	lease := idempotency.WithLease(time.Minute)
	opts := []idempotency.Option{lease, idempotency.WithKeyPrefix("a:")}
	a := idempotency.Idempotent(s, opts...)(ok)
	b := idempotency.Idempotent(s, append(opts[:len(opts):len(opts)], idempotency.WithKeyPrefix("b:"), idempotency.WithLease(2*time.Minute))...)(ok)
	if err := idempotency.Lock(t.Context(), s, "lock", func(context.Context) error { return nil }, lease, idempotency.WithLease(3*time.Minute)); err != nil {
		t.Fatal(err)
	}
	p := idempotency.PushHandler(s, ok, opts...)
	for i, h := range []idempotency.CloudEventFunc{a, b, a} {
		id := fmt.Sprint("m-", i)
		if err := h(t.Context(), pubsubEvent(t, id, map[string]any{"messageId": id})); err != nil {
			t.Fatal(err)
		}
	}
	if code := send(t, p, `{"message":{"messageId":"m-3"}}`, nil); code != http.StatusNoContent {
		t.Fatalf("PushHandler: HTTP %d", code)
	}
	// The fake keeps a done record's lease expiry: the lease each call used.
	for key, want := range map[string]time.Duration{"a:m-0": time.Minute, "b:m-1": 2 * time.Minute, "a:m-2": time.Minute,
		"a:m-3": time.Minute, "lock": 3 * time.Minute} {
		rec, ok := s.Record(key)
		if !ok || !rec.LeaseExpiry.Equal(epoch.Add(want)) {
			t.Errorf("record %q = %+v (present %v), want a lease of %v", key, rec, ok, want)
		}
	}
	if s.Len() != 5 {
		t.Fatalf("%d records, want 5", s.Len())
	}
}
