package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
)

// orderEvent is a Pub/Sub CloudEvent of message id, with the attribute
// tenant and the JSON payload order.
func orderEvent(id, tenant string, order map[string]any) cloudevents.Event {
	data, _ := json.Marshal(map[string]any{"order": order})
	e := cloudevents.NewEvent()
	e.SetID(id)
	e.SetSource("//pubsub.googleapis.com/projects/my-project/topics/orders")
	e.SetType(idempotency.PubSubEventType)
	_ = e.SetData(cloudevents.ApplicationJSON, map[string]any{
		"message": map[string]any{"messageId": id, "attributes": map[string]string{"tenant": tenant}, "data": data},
	})
	return e
}

func ExampleCompositeKey() {
	// Order ids are unique per tenant only: key by both.
	key := idempotency.CompositeKey(idempotency.AttributePart("tenant"), idempotency.JSONFieldPart("order", "id"))
	backend := fake.New()
	fn := idempotency.Idempotent(backend, idempotency.WithKey(key))(func(ctx context.Context, e cloudevents.Event) error {
		fmt.Println("processing message", e.ID())
		return nil
	})
	_ = fn(context.Background(), orderEvent("1001", "acme", map[string]any{"id": "PO-7"}))
	_ = fn(context.Background(), orderEvent("1002", "acme", map[string]any{"id": "PO-7"}))    // a republish: a duplicate
	_ = fn(context.Background(), orderEvent("1003", "initech", map[string]any{"id": "PO-7"})) // another tenant's PO-7

	// The parts are joined by "|", each escaped, so that no two tuples
	// share a key.
	k, _ := key(orderEvent("1004", "a|b", map[string]any{"id": "c"}))
	fmt.Println(k)
	_, err := key(orderEvent("1005", "acme", map[string]any{"id": []string{"PO-7"}}))
	fmt.Println(errors.Is(err, idempotency.ErrMalformedEvent))
	// Output:
	// processing message 1001
	// processing message 1003
	// a\|b|c
	// true
}

func ExampleJSONFieldsFingerprint() {
	// Compare the quantity, not the send time that every publish changes.
	backend := fake.New()
	fn := idempotency.Idempotent(backend,
		idempotency.WithKey(idempotency.JSONField("order", "id")),
		idempotency.WithFingerprint(idempotency.JSONFieldsFingerprint([]string{"order", "qty"})),
	)(func(ctx context.Context, e cloudevents.Event) error {
		fmt.Println("processing message", e.ID())
		return nil
	})
	for _, e := range []cloudevents.Event{
		orderEvent("1001", "acme", map[string]any{"id": "PO-7", "qty": 3, "sent": "10:00"}),
		orderEvent("1002", "acme", map[string]any{"id": "PO-7", "qty": 3, "sent": "10:05"}),
		orderEvent("1003", "acme", map[string]any{"id": "PO-7", "qty": 999, "sent": "10:06"}),
	} {
		if err := fn(context.Background(), e); errors.Is(err, idempotency.ErrPayloadMismatch) {
			fmt.Println("message", e.ID(), "changed the order: nacked to the dead-letter topic")
		}
	}
	// Output:
	// processing message 1001
	// message 1003 changed the order: nacked to the dead-letter topic
}
