package idempotency_test

import (
	"errors"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"
	"github.com/google/go-cmp/cmp"

	"github.com/gcp-pubsub-idempotency/idempotency"
)

func TestParsePubSub(t *testing.T) {
	e := cloudevents.NewEvent()
	e.SetID("ce-1")
	e.SetType(idempotency.PubSubEventType)
	e.SetSource("//pubsub.googleapis.com/projects/p/topics/t")
	e.SetData(cloudevents.ApplicationJSON, map[string]any{
		"message": map[string]any{
			"messageId":   "m-1",
			"data":        payload("hi"),
			"attributes":  map[string]string{"a": "b"},
			"orderingKey": "ok-1",
			"publishTime": "2026-11-29T12:00:00.5Z",
		},
		"subscription":    "projects/p/subscriptions/s",
		"deliveryAttempt": 3,
	})
	got, err := idempotency.ParsePubSub(e)
	if err != nil {
		t.Fatal(err)
	}
	want := idempotency.PubSubEvent{
		Message: idempotency.PubSubMessage{
			ID:          "m-1",
			Data:        []byte(`"hi"`),
			Attributes:  map[string]string{"a": "b"},
			OrderingKey: "ok-1",
			PublishTime: epoch.Add(500 * time.Millisecond),
		},
		Subscription:    "projects/p/subscriptions/s",
		DeliveryAttempt: 3,
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("(-want +got):\n%s", diff)
	}
}

func TestMalformedEventsAreErrors(t *testing.T) {
	notJSON := cloudevents.NewEvent()
	notJSON.SetID("x")
	notJSON.SetData("text/plain", []byte("hello"))
	noMessage := cloudevents.NewEvent()
	noMessage.SetID("y")
	noMessage.SetData(cloudevents.ApplicationJSON, map[string]any{"subscription": "s"})
	badBase64 := cloudevents.NewEvent()
	badBase64.SetID("z")
	badBase64.SetData(cloudevents.ApplicationJSON, map[string]any{"message": map[string]any{"data": "%%%"}})
	for name, e := range map[string]cloudevents.Event{"not JSON": notJSON, "no message": noMessage} {
		if _, err := idempotency.MessageID()(e); !errors.Is(err, idempotency.ErrMalformedEvent) {
			t.Errorf("MessageID, %s: err = %v, want ErrMalformedEvent", name, err)
		}
	}
	for name, e := range map[string]cloudevents.Event{"not JSON": notJSON, "no message": noMessage, "bad base64": badBase64} {
		if _, err := idempotency.ParsePubSub(e); !errors.Is(err, idempotency.ErrMalformedEvent) {
			t.Errorf("ParsePubSub, %s: err = %v, want ErrMalformedEvent", name, err)
		}
	}
	// The default key reads only the ids: a payload it cannot decode is the
	// handler's business, not a reason to refuse the delivery.
	if k, err := idempotency.MessageID()(badBase64); k != "" || err != nil {
		t.Errorf("MessageID of a bad payload without ids = %q, %v; want unkeyed", k, err)
	}
}
