package idempotency

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// MaxPushBody is the largest request body [PushHandler] reads: Pub/Sub's
// 10 MB message limit, base64-encoded, plus the envelope.
const MaxPushBody = 16 << 20

// PushHandler returns an http.Handler for a Cloud Run service (or any
// net/http server) that receives Pub/Sub deliveries without the functions
// framework. It accepts both shapes a push can have:
//
//   - a raw push envelope, as a push subscription posts it:
//     {"message": {...}, "subscription": "...", "deliveryAttempt": N};
//   - a CloudEvent, binary or structured, as Eventarc posts it.
//
// It guards h exactly as [Idempotent](b, opts...) does, and writes the
// status the functions framework would write for the same outcome (the
// table and the reasons are at Idempotent), except that an ack is a 204:
//
//	handler returned nil, or duplicate       204 No Content   ack
//	key held by a live lease elsewhere       503              nack, retried later
//	handler's error wraps ErrInProgress      503              nack, retried later
//	handler's error carries a cloudevents    that status      nack
//	HTTP result with a 4xx or 5xx status
//	handler's error carries any other        500              nack
//	status (1xx, 2xx, 3xx, out of range)
//	handler or claim error                   500              nack, retried
//	no key, malformed event, key the port    400              nack, retried
//	refuses ([store.ErrInvalidKey])
//
// and, for requests the functions framework would answer itself:
//
//	malformed envelope or CloudEvent         400              nack, retried
//	not a POST                               405
//	body over MaxPushBody                    413
//
// Only the guard's own outcomes ack (see Idempotent): a handler's error
// that wraps [ErrDuplicate] is a failure, answered 500.
//
// A raw envelope becomes a CloudEvent of type [PubSubEventType] whose id is
// the messageId and whose data is the envelope itself, so [ParsePubSub] sees
// the subscription and deliveryAttempt (which the functions framework's own
// conversion drops). Errors are logged at ERROR, contention at WARN, and
// the error text is the response body. PushHandler panics on what
// Idempotent panics on.
func PushHandler(b store.Backend, h CloudEventFunc, opts ...Option) http.Handler {
	cfg := newConfig(opts)
	guarded := Idempotent(b, opts...)(h)
	log := cfg.lock.log()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			w.Header().Set("Allow", http.MethodPost)
			http.Error(w, "Pub/Sub push requests are POSTs", http.StatusMethodNotAllowed)
			return
		}
		e, status, err := pushEvent(r)
		if err != nil {
			log.WarnContext(r.Context(), "idempotency: refusing a push request", "status", status, "error", err)
			http.Error(w, err.Error(), status)
			return
		}
		err = guarded(r.Context(), e)
		if err == nil {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		// The status the functions framework would write for err (see
		// wireStatus): Idempotent gives every failure a 4xx or 5xx.
		status = wireStatus(err)
		if status < 400 || status > 599 {
			status = http.StatusInternalServerError // never an ack for a failure
		}
		if status != http.StatusServiceUnavailable { // contention was logged already
			log.ErrorContext(r.Context(), "idempotency: push delivery failed; nacking", "status", status,
				"event_id", e.ID(), "error", err)
		}
		http.Error(w, err.Error(), status)
	})
}

// unidentifiedPushType marks a raw push envelope without a messageId.
const unidentifiedPushType = "io.github.gcp-pubsub-idempotency.push.unidentified"

// pushEvent reads the request as a CloudEvent or a raw push envelope.
func pushEvent(r *http.Request) (event.Event, int, error) {
	body, err := io.ReadAll(io.LimitReader(r.Body, MaxPushBody+1))
	if err != nil {
		return event.Event{}, http.StatusBadRequest, fmt.Errorf("reading the body: %w", err)
	}
	if len(body) > MaxPushBody {
		return event.Event{}, http.StatusRequestEntityTooLarge, fmt.Errorf("body over %d bytes", MaxPushBody)
	}
	if r.Header.Get("Ce-Id") != "" || strings.Contains(r.Header.Get("Content-Type"), "cloudevents") {
		r.Body = io.NopCloser(strings.NewReader(string(body)))
		e, err := cehttp.NewEventFromHTTPRequest(r)
		if err != nil {
			return event.Event{}, http.StatusBadRequest, fmt.Errorf("%w: not a valid CloudEvent: %v", ErrMalformedEvent, err)
		}
		return *e, 0, nil
	}
	var env struct {
		Message *struct {
			MessageID    string `json:"messageId"`
			MessageIDAlt string `json:"message_id"`
			PublishTime  string `json:"publishTime"`
		} `json:"message"`
		Subscription string `json:"subscription"`
	}
	if err := json.Unmarshal(body, &env); err != nil {
		return event.Event{}, http.StatusBadRequest, fmt.Errorf("%w: body is not a Pub/Sub push envelope: %v", ErrMalformedEvent, err)
	}
	if env.Message == nil {
		return event.Event{}, http.StatusBadRequest, fmt.Errorf("%w: push envelope has no \"message\"", ErrMalformedEvent)
	}
	e := event.New()
	e.SetType(PubSubEventType)
	e.SetID(firstNonEmpty(env.Message.MessageID, env.Message.MessageIDAlt))
	if e.ID() == "" {
		// A CloudEvent needs an id, but this one must not become the key:
		// with a type other than PubSubEventType, MessageID finds no key and
		// the delivery fails closed.
		e.SetID("unidentified")
		e.SetType(unidentifiedPushType)
	}
	src := "//pubsub.googleapis.com/"
	if env.Subscription != "" {
		src += env.Subscription
	}
	e.SetSource(src)
	if t, err := time.Parse(time.RFC3339Nano, env.Message.PublishTime); err == nil {
		e.SetTime(t)
	}
	if err := e.SetData(event.ApplicationJSON, json.RawMessage(body)); err != nil {
		return event.Event{}, http.StatusBadRequest, fmt.Errorf("%w: %v", ErrMalformedEvent, err)
	}
	return e, 0, nil
}
