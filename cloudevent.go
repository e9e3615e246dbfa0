package idempotency

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"
)

// PubSubEventType is the CloudEvent type Eventarc and the functions
// framework give a Pub/Sub message.
const PubSubEventType = "google.cloud.pubsub.topic.v1.messagePublished"

// ErrMalformedEvent reports an event whose data is not a Pub/Sub message
// envelope (not JSON, or without a "message" object), or whose payload
// has no usable business key where [JSONField] reads one (see there).
// [Idempotent] and [PushHandler] refuse such an event with a 400 nack, as
// they do an unkeyed one ([ErrNoKey]).
var ErrMalformedEvent = errors.New("idempotency: malformed event")

// PubSubMessage is the message inside a Pub/Sub CloudEvent.
type PubSubMessage struct {
	// ID is the messageId Pub/Sub assigned at publish time. Every delivery
	// of one publish, to every subscription, carries the same ID.
	ID string
	// Data is the payload, decoded from base64.
	Data []byte
	// Attributes are the publisher's key/value attributes.
	Attributes map[string]string
	// OrderingKey is the ordering key, if the publisher set one.
	OrderingKey string
	// PublishTime is when Pub/Sub accepted the message; zero if absent.
	PublishTime time.Time
}

// PubSubEvent is the Pub/Sub view of a CloudEvent's data.
type PubSubEvent struct {
	Message PubSubMessage
	// Subscription is the full subscription name, when the sender gave it
	// (Eventarc does; a raw push converted by the functions framework does
	// not).
	Subscription string
	// DeliveryAttempt counts deliveries of this message, when the
	// subscription has a dead-letter policy; zero otherwise.
	DeliveryAttempt int
}

type wireMessage struct {
	Data         []byte            `json:"data"`
	Attributes   map[string]string `json:"attributes"`
	MessageID    string            `json:"messageId"`
	MessageIDAlt string            `json:"message_id"`
	OrderingKey  string            `json:"orderingKey"`
	PublishTime  string            `json:"publishTime"`
	PublishAlt   string            `json:"publish_time"`
}

type wireEnvelope struct {
	Message         *wireMessage `json:"message"`
	Subscription    string       `json:"subscription"`
	DeliveryAttempt int          `json:"deliveryAttempt"`
}

// ParsePubSub reads the Pub/Sub message envelope from e's data. The message
// ID is data.message.messageId, else data.message.message_id, else, for an
// event of type [PubSubEventType], the CloudEvent id. An ID that is still
// empty is not an error: the caller decides what an unkeyed message means.
// Data that is not a JSON envelope with a "message" object yields an error
// wrapping [ErrMalformedEvent].
func ParsePubSub(e event.Event) (PubSubEvent, error) {
	var w wireEnvelope
	if err := json.Unmarshal(e.Data(), &w); err != nil {
		return PubSubEvent{}, fmt.Errorf("%w: event %q data is not a Pub/Sub JSON envelope: %v", ErrMalformedEvent, e.ID(), err)
	}
	if w.Message == nil {
		return PubSubEvent{}, fmt.Errorf("%w: event %q data has no \"message\" object", ErrMalformedEvent, e.ID())
	}
	m := w.Message
	ev := PubSubEvent{
		Message: PubSubMessage{
			ID:          firstNonEmpty(m.MessageID, m.MessageIDAlt),
			Data:        m.Data,
			Attributes:  m.Attributes,
			OrderingKey: m.OrderingKey,
		},
		Subscription:    w.Subscription,
		DeliveryAttempt: w.DeliveryAttempt,
	}
	if ev.Message.ID == "" && e.Type() == PubSubEventType {
		ev.Message.ID = e.ID()
	}
	if ts := firstNonEmpty(m.PublishTime, m.PublishAlt); ts != "" {
		if t, err := time.Parse(time.RFC3339Nano, ts); err == nil {
			ev.Message.PublishTime = t
		}
	}
	return ev, nil
}

func firstNonEmpty(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
