package pubsubtest

import (
	"context"
	"net/http/httptest"

	cloudevents "github.com/cloudevents/sdk-go/v2"
	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/wire"
)

// Status returns the HTTP status the functions framework answers a
// delivery with when a CloudEvent function returns err: 200 for nil (an
// ack), the status of a [cehttp.Result] that err wraps (idempotency's
// wrappers give every failure one: 400, 409, 503, ...), and 500 for any
// other error. Pub/Sub acks a 102, 200, 201, 202 or 204 and redelivers
// anything else. It is how a unit test that calls a wrapped function
// directly tells what Pub/Sub would do with the delivery:
//
//	err := guarded(ctx, msg.Event())
//	if got := pubsubtest.Status(err); got != http.StatusServiceUnavailable { ... }
//
// [cehttp.Result]: https://pkg.go.dev/github.com/cloudevents/sdk-go/v2/protocol/http#Result
func Status(err error) int { return wire.Status(err) }

// NewServer starts a server that serves f as the functions framework
// serves a CloudEvent function, for a test that sends it requests and
// then stops it with Close (the framework's own server cannot be stopped,
// and serves functions from a global registry). It answers
// [Message.BinaryRequest] and [Message.StructuredRequest] (the shapes in
// which Eventarc delivers a Pub/Sub message to a function) with the
// framework's CloudEvent receiver, cloudevents sdk-go's, so f receives
// the same event and its return value goes out with the same status
// ([Status]). A plain push envelope ([Message.PushRequest]), which the
// framework converts to a CloudEvent first, is not converted here: the
// receiver refuses it (415 Unsupported Media Type) and f does not run.
// Serve such deliveries with idempotency.PushHandler.
//
// It panics if the receiver cannot be built, as httptest.NewServer does
// when it cannot listen.
func NewServer(f func(context.Context, event.Event) error) *httptest.Server {
	p, err := cloudevents.NewHTTP()
	if err != nil {
		panic("pubsubtest: " + err.Error())
	}
	h, err := cloudevents.NewHTTPReceiveHandler(context.Background(), p, f)
	if err != nil {
		panic("pubsubtest: " + err.Error())
	}
	return httptest.NewServer(h)
}
