// Package pubsubtest builds Pub/Sub deliveries for unit tests of push
// handlers, in every shape a handler guarded by
// [github.com/gcp-pubsub-idempotency/idempotency] can receive one:
//
//   - [Message.Event]: the CloudEvent a Pub/Sub-triggered function receives
//     from Eventarc (type [EventType], source
//     //pubsub.googleapis.com/projects/P/topics/T, data the push envelope
//     {"message": {...}, "subscription": ..., "deliveryAttempt": N}), to call
//     a guarded function directly;
//   - [Message.BinaryRequest] and [Message.StructuredRequest]: that
//     CloudEvent as an HTTP request in binary mode (Ce-* headers, as Eventarc
//     posts it) and in structured mode (application/cloudevents+json);
//   - [Message.PushRequest]: the JSON envelope a plain push subscription
//     posts, to the path /projects/P/topics/T that the functions framework
//     needs to convert it;
//   - [Message.UnwrappedRequest]: a push subscription with payload unwrapping
//     (--push-no-wrapper), whose body is the message data itself, with or
//     without write metadata (--push-no-wrapper-write-metadata).
//
// The requests are server-side requests, ready for an [net/http.Handler]'s
// ServeHTTP (such as idempotency.PushHandler's); [Send] posts one to a
// running server instead, such as the functions framework in a test.
// [NewServer] serves a function as the framework does, on a server a test
// can close, and [Status] tells, from what a function returned, the
// status the framework answers (and so whether Pub/Sub acks).
//
// Every shape built from one Message is the same message: a Message whose
// ID is empty gets a fresh random messageId (16 decimal digits, as Pub/Sub's)
// on its first build, and keeps it, so building it twice makes a
// redelivery, and [Message.Republished] makes a new publish of the same
// content. A zero PublishTime likewise becomes the time of the first build.
//
// # Unwrapped push headers
//
// With write metadata, Pub/Sub puts the message's metadata in these request
// headers (named as in Pub/Sub's documentation on payload unwrapping) and
// each attribute in a header named after it:
//
//	x-goog-pubsub-message-id           HeaderMessageID
//	x-goog-pubsub-subscription-name    HeaderSubscription
//	x-goog-pubsub-publish-time         HeaderPublishTime
//	x-goog-pubsub-ordering-key         HeaderOrderingKey (only when set)
//
// Pub/Sub writes no header for the delivery attempt, so an unwrapped request
// carries no DeliveryAttempt; without write metadata it carries the data
// alone, and no message id to key on. These are the headers idempotency's
// PushHandler reads when given
// [github.com/gcp-pubsub-idempotency/idempotency.WithUnwrappedPush].
package pubsubtest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"
)

// EventType is the CloudEvent type of a published Pub/Sub message, the
// same string as idempotency.PubSubEventType.
const EventType = "google.cloud.pubsub.topic.v1.messagePublished"

// The request headers in which Pub/Sub writes a message's metadata on an
// unwrapped push with write metadata. http.Header canonicalizes them
// (X-Goog-Pubsub-Message-Id), so Header.Get finds them in any case.
const (
	// HeaderMessageID carries the messageId.
	HeaderMessageID = "x-goog-pubsub-message-id"
	// HeaderSubscription carries the full subscription name,
	// projects/P/subscriptions/S.
	HeaderSubscription = "x-goog-pubsub-subscription-name"
	// HeaderPublishTime carries the publish time, RFC 3339 in UTC.
	HeaderPublishTime = "x-goog-pubsub-publish-time"
	// HeaderOrderingKey carries the ordering key; absent when the message
	// has none.
	HeaderOrderingKey = "x-goog-pubsub-ordering-key"
)

// The topic and subscription of a Message that names none.
const (
	DefaultTopic        = "projects/test-project/topics/test-topic"
	DefaultSubscription = "projects/test-project/subscriptions/test-subscription"
)

// Message is one published Pub/Sub message and the delivery that carries
// it. Every field is optional; the zero Message is a message without data
// or attributes, on [DefaultTopic] and [DefaultSubscription].
//
// The builders take a pointer because the first one fills in ID and
// PublishTime when they are empty; they are safe to call concurrently on
// one Message (a test of concurrent duplicates), as long as nothing else
// writes the Message meanwhile.
type Message struct {
	// ID is the messageId. Empty: a fresh random one, chosen by the first
	// builder called and kept in the Message.
	ID string
	// Data is the payload (sent base64-encoded in the JSON shapes, as is in
	// the unwrapped one).
	Data []byte
	// Attributes are the publisher's attributes.
	Attributes map[string]string
	// OrderingKey is the publisher's ordering key; empty: none.
	OrderingKey string
	// PublishTime is when Pub/Sub accepted the message. Zero: the time of
	// the first build, to the millisecond, kept in the Message.
	PublishTime time.Time
	// DeliveryAttempt is the deliveryAttempt of the envelope, which Pub/Sub
	// sends only for a subscription with a dead-letter policy; zero: absent.
	DeliveryAttempt int
	// Topic is the full topic name, projects/P/topics/T; empty:
	// [DefaultTopic]. It makes the CloudEvent's source and the push path.
	Topic string
	// Subscription is the full subscription name,
	// projects/P/subscriptions/S; empty: [DefaultSubscription].
	Subscription string
}

// fillMu orders the first build of a Message (which writes ID and
// PublishTime) before every other build of it.
var fillMu sync.Mutex

// filled completes m's ID and PublishTime if they are empty, and returns a
// copy with the defaults applied.
func (m *Message) filled() Message {
	fillMu.Lock()
	if m.ID == "" {
		m.ID = NewID()
	}
	if m.PublishTime.IsZero() {
		m.PublishTime = time.Now().UTC().Truncate(time.Millisecond)
	}
	c := *m
	fillMu.Unlock()
	c.PublishTime = c.PublishTime.UTC()
	if c.Topic == "" {
		c.Topic = DefaultTopic
	}
	if c.Subscription == "" {
		c.Subscription = DefaultSubscription
	}
	return c
}

// NewID returns a random messageId shaped like Pub/Sub's: 16 decimal
// digits. Two calls collide with odds of about one in 10^15.
func NewID() string {
	return strconv.FormatInt(1e15+rand.Int64N(9e15), 10)
}

// Republished returns a new publish of m's content: the same data,
// attributes and ordering key under a new messageId (chosen at its first
// build) and a new publish time, as when a producer publishes the same
// order again. Its delivery attempt is cleared.
func (m *Message) Republished() Message {
	fillMu.Lock()
	r := *m
	fillMu.Unlock()
	r.ID, r.PublishTime, r.DeliveryAttempt = "", time.Time{}, 0
	r.Attributes = maps.Clone(r.Attributes)
	r.Data = bytes.Clone(r.Data)
	return r
}

// wireMessage is the "message" object of a push envelope. Field order is
// the order Pub/Sub writes them in.
type wireMessage struct {
	Attributes   map[string]string `json:"attributes,omitempty"`
	Data         []byte            `json:"data,omitempty"`
	MessageID    string            `json:"messageId"`
	MessageIDAlt string            `json:"message_id,omitempty"`
	OrderingKey  string            `json:"orderingKey,omitempty"`
	PublishTime  string            `json:"publishTime"`
	PublishAlt   string            `json:"publish_time,omitempty"`
}

type wireEnvelope struct {
	Message         wireMessage `json:"message"`
	Subscription    string      `json:"subscription,omitempty"`
	DeliveryAttempt int         `json:"deliveryAttempt,omitempty"`
}

// envelope encodes c as a push envelope. A push subscription and Eventarc
// write both spellings of messageId and publishTime; the structured
// CloudEvents of Google's published examples only the camelCase ones.
func (c Message) envelope(bothSpellings bool) []byte {
	ts := publishTime(c.PublishTime)
	w := wireEnvelope{
		Message: wireMessage{
			Attributes:  c.Attributes,
			Data:        c.Data,
			MessageID:   c.ID,
			OrderingKey: c.OrderingKey,
			PublishTime: ts,
		},
		Subscription:    c.Subscription,
		DeliveryAttempt: c.DeliveryAttempt,
	}
	if bothSpellings {
		w.Message.MessageIDAlt, w.Message.PublishAlt = c.ID, ts
	}
	return marshal(w)
}

// marshal encodes v as compact JSON without escaping <, > and &, as
// Pub/Sub writes it.
func marshal(v any) []byte {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		panic(fmt.Sprintf("pubsubtest: encoding %T: %v", v, err)) // only maps of strings, strings and ints
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
}

func publishTime(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

// event builds the CloudEvent of c with the given data.
func (c Message) event(data []byte) event.Event {
	e := event.New(event.CloudEventsVersionV1)
	e.SetID(c.ID)
	e.SetSource("//pubsub.googleapis.com/" + c.Topic)
	e.SetType(EventType)
	e.SetTime(c.PublishTime)
	// As a binary-mode request's body becomes the data: JSON, not base64
	// (SetData would mark bytes as base64).
	e.SetDataContentType(event.ApplicationJSON)
	e.DataEncoded = data
	return e
}

// Event returns the CloudEvent Eventarc delivers for m to a Pub/Sub-
// triggered function, as the functions framework passes it to the
// function: id the messageId, source //pubsub.googleapis.com/ and the
// topic, type [EventType], time the publish time, and data the push
// envelope (message, subscription, deliveryAttempt when set). It is the
// event [Message.BinaryRequest] carries.
func (m *Message) Event() event.Event {
	c := m.filled()
	return c.event(c.envelope(true))
}

// BinaryRequest returns m as Eventarc posts it: a binary-mode CloudEvent,
// the attributes in Ce-* headers and the push envelope as the JSON body.
func (m *Message) BinaryRequest() *http.Request {
	c := m.filled()
	r := newRequest("/", c.envelope(true))
	r.Header.Set("Content-Type", event.ApplicationJSON)
	r.Header.Set("Ce-Id", c.ID)
	r.Header.Set("Ce-Source", "//pubsub.googleapis.com/"+c.Topic)
	r.Header.Set("Ce-Specversion", event.CloudEventsVersionV1)
	r.Header.Set("Ce-Type", EventType)
	r.Header.Set("Ce-Time", publishTime(c.PublishTime))
	r.Header.Set("User-Agent", "APIs-Google; (+https://developers.google.com/webmasters/APIs-Google.html)")
	return r
}

// StructuredRequest returns m as a structured-mode CloudEvent: the whole
// event as one application/cloudevents+json body, its data the envelope
// with the camelCase fields only (messageId, publishTime).
func (m *Message) StructuredRequest() *http.Request {
	c := m.filled()
	e := c.event(c.envelope(false))
	body, err := json.Marshal(e)
	if err != nil {
		panic(fmt.Sprintf("pubsubtest: encoding the CloudEvent: %v", err)) // a valid event with JSON data
	}
	r := newRequest("/", body)
	r.Header.Set("Content-Type", event.ApplicationCloudEventsJSON+"; charset=UTF-8")
	return r
}

// PushRequest returns m as a push subscription posts it: the JSON envelope
// {"message": {...}, "subscription": ..., "deliveryAttempt": N} to
// /projects/P/topics/T, the path from which the functions framework reads
// the topic when it converts a push into a CloudEvent. That conversion keeps
// the messageId, data, attributes and publish time only: a function behind
// the framework sees no subscription, delivery attempt or ordering key;
// idempotency.PushHandler sees them all.
func (m *Message) PushRequest() *http.Request {
	c := m.filled()
	r := newRequest("/"+c.Topic, c.envelope(true))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("User-Agent", "CloudPubSub-Google")
	return r
}

// UnwrappedRequest returns m as a push subscription with payload unwrapping
// posts it: the body is the message data itself. withMetadata adds what
// write metadata adds: the attributes, each in a header of its own name,
// then [HeaderMessageID], [HeaderSubscription], [HeaderPublishTime] and, when
// m has an ordering key, [HeaderOrderingKey] (an attribute of the same name
// is overwritten). Without it the request carries the data alone. There is
// no Content-Type header unless an attribute named Content-Type gives one.
func (m *Message) UnwrappedRequest(withMetadata bool) *http.Request {
	c := m.filled()
	r := newRequest("/", c.Data)
	r.Header.Set("User-Agent", "CloudPubSub-Google")
	if !withMetadata {
		return r
	}
	for k, v := range c.Attributes {
		r.Header.Set(k, v)
	}
	r.Header.Set(HeaderMessageID, c.ID)
	r.Header.Set(HeaderSubscription, c.Subscription)
	r.Header.Set(HeaderPublishTime, publishTime(c.PublishTime))
	if c.OrderingKey != "" {
		r.Header.Set(HeaderOrderingKey, c.OrderingKey)
	}
	return r
}

// newRequest returns a server-side POST of body to path.
func newRequest(path string, body []byte) *http.Request {
	return httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body))
}

// Send posts r, a request from one of the builders, to the server at
// baseURL (such as "http://127.0.0.1:8080") with [http.DefaultClient]: the
// same method, path, headers and body, under r's context. It reads r's
// body. The caller closes the response's body.
func Send(baseURL string, r *http.Request) (*http.Response, error) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return nil, fmt.Errorf("pubsubtest: reading the request body: %w", err)
	}
	out, err := http.NewRequestWithContext(r.Context(), r.Method,
		strings.TrimSuffix(baseURL, "/")+r.URL.RequestURI(), bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("pubsubtest: %w", err)
	}
	out.Header = r.Header.Clone()
	return http.DefaultClient.Do(out)
}
