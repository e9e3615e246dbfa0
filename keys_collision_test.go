package idempotency_test

import (
	"context"
	"testing"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
)

// Under DefaultKey a Pub/Sub message whose messageId holds the separator
// (a forged push carries whatever messageId it is sent with) does not
// take the key of the Cloud Storage event whose source and id it spells:
// the storage event, arriving after it, still runs. Found in review of
// 2f188c8, where the storage event was acked as a duplicate unrun (its
// data is not a Pub/Sub envelope: no fingerprint was compared).
func TestDefaultKeyOfAMessageNeverEqualsAnEventIDKey(t *testing.T) {
	const source, id = "//storage.googleapis.com/projects/_/buckets/b", "123"
	msg := pubsubEvent(t, "ce-1", map[string]any{"messageId": source + "|" + id, "data": payload("x")})
	obj := cloudevents.NewEvent()
	obj.SetType("google.cloud.storage.object.v1.finalized")
	obj.SetSource(source)
	obj.SetID(id)
	if err := obj.SetData(cloudevents.ApplicationJSON, map[string]any{"name": "o", "bucket": "b"}); err != nil {
		t.Fatal(err)
	}
	k1, _ := idempotency.DefaultKey()(msg)
	k2, _ := idempotency.DefaultKey()(obj)
	if k1 == k2 {
		t.Errorf("DefaultKey: the Pub/Sub message and the storage event share the key %q", k1)
	}
	ran := map[string]int{}
	h := idempotency.Idempotent(fake.New(), idempotency.WithLogger(newDiscard()))(func(ctx context.Context, e cloudevents.Event) error {
		ran[e.Type()]++
		return nil
	})
	if err := h(context.Background(), msg); err != nil {
		t.Fatal(err)
	}
	err := h(context.Background(), obj)
	if ran[obj.Type()] != 1 {
		t.Errorf("the storage event did not run (handler answered %v: acked as a duplicate of the Pub/Sub message)", err)
	}
}
