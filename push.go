package idempotency

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/event"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// MaxPushBody is the largest request body [PushHandler] reads: Pub/Sub's
// 10 MB message limit, base64-encoded, plus the envelope.
const MaxPushBody = 16 << 20

// The headers in which Pub/Sub writes a message's metadata on an unwrapped
// push from a subscription created with --push-no-wrapper and
// --push-no-wrapper-write-metadata (PushConfig.NoWrapper.write_metadata:
// "x-goog-pubsub-<KEY>" headers for the metadata, and one header named
// after each attribute; see
// https://cloud.google.com/pubsub/docs/payload-unwrapping). Header names
// are case-insensitive; these are Go's canonical spellings.
const (
	// PushMessageIDHeader carries the messageId: the default key of an
	// unwrapped delivery.
	PushMessageIDHeader = "X-Goog-Pubsub-Message-Id"
	// PushPublishTimeHeader carries the publish time (RFC 3339).
	PushPublishTimeHeader = "X-Goog-Pubsub-Publish-Time"
	// PushSubscriptionHeader carries the full subscription name.
	PushSubscriptionHeader = "X-Goog-Pubsub-Subscription-Name"
	// PushOrderingKeyHeader carries the ordering key, when the message has
	// one.
	PushOrderingKeyHeader = "X-Goog-Pubsub-Ordering-Key"
)

// ErrPushForbidden is what a verifier given to [WithPushAuth] wraps to
// say that the request's credential is valid but names a sender that may
// not deliver: [PushHandler] answers it 403 rather than 401.
var ErrPushForbidden = errors.New("idempotency: push sender not allowed")

// pushConfig is what the options only PushHandler reads set.
type pushConfig struct {
	unwrapped bool
	attrs     []string
	auth      func(*http.Request) error
	authSet   bool
}

// pushOption is an Option that only PushHandler reads: Idempotent (and
// the functions framework behind it) never sees the HTTP request.
type pushOption func(*pushConfig)

func (pushOption) applyIdempotent(*config) {}

// newPushConfig applies the push options among opts, in order.
func newPushConfig(opts []Option) pushConfig {
	var pc pushConfig
	for _, o := range opts {
		if p, ok := o.(pushOption); ok {
			p(&pc)
		}
	}
	return pc
}

// validate reports a push option that is a mistake in the program.
func (pc *pushConfig) validate() error {
	if pc.authSet && pc.auth == nil {
		return fmt.Errorf("nil push verifier in WithPushAuth")
	}
	seen := map[string]bool{}
	for _, a := range pc.attrs {
		if !isToken(a) {
			return fmt.Errorf("WithUnwrappedPush: attribute %q cannot travel as an HTTP header name", a)
		}
		c := http.CanonicalHeaderKey(a)
		if strings.HasPrefix(c, "X-Goog-Pubsub-") {
			return fmt.Errorf("WithUnwrappedPush: %q is a Pub/Sub metadata header, not an attribute", a)
		}
		if seen[c] {
			return fmt.Errorf("WithUnwrappedPush: attribute %q is named twice (header names ignore case)", a)
		}
		seen[c] = true
	}
	return nil
}

// isToken reports whether s is an HTTP token (RFC 9110), which a header
// name must be.
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// WithUnwrappedPush makes [PushHandler] serve a push subscription created
// with payload unwrapping (gcloud's --push-no-wrapper): the request body
// is the message data itself, as published. It is a choice, not a
// detection: the body of an unwrapped push is whatever the publisher
// wrote, and it may be a JSON object that looks exactly like a push
// envelope or a structured CloudEvent; with write-metadata, every
// attribute becomes a header, so a publisher can also add a Ce-Id or a
// Content-Type header of its choosing. Nothing in such a request tells it
// apart from a wrapped one, and reading it as one would key it on bytes
// the publisher chose. So with this option, every request's body is the
// message data, never an envelope or a CloudEvent; without it, no request
// is read as unwrapped.
//
// With --push-no-wrapper-write-metadata, the message's metadata comes in
// the headers [PushMessageIDHeader], [PushPublishTimeHeader],
// [PushSubscriptionHeader] and [PushOrderingKeyHeader]: the default key,
// [MessageID], is then the message id header, as it is the envelope's
// messageId on a wrapped push, and [ParsePubSub] sees the message as if
// it had come in an envelope. The attributes come as headers named after
// them, among the other headers of the request (User-Agent,
// Authorization, trace headers a proxy adds), so PushHandler passes on
// only the attributes named here, under the name given here: their
// header names ignore case, and HTTP trims spaces around their values.
// Pub/Sub writes no delivery attempt on an unwrapped push, so
// DeliveryAttempt stays zero.
//
// Without write-metadata, the request carries no message id at all: only
// a key read from the payload can work, such as
// WithKey(JSONField("order", "id")); under the default key every delivery
// is refused with a 400 that says so (an error wrapping [ErrNoKey]), and
// reaches the dead-letter topic rather than running unguarded.
//
// A request whose metadata or named attribute header is repeated, or is
// not valid UTF-8, is refused with a 400 (an error wrapping
// [ErrMalformedEvent]): it has no single value to key on. PushHandler
// panics on an attribute name that cannot be a header name, that names a
// metadata header, or that is given twice. [Idempotent] ignores this
// option: the functions framework does not take unwrapped pushes.
func WithUnwrappedPush(attributes ...string) Option {
	attrs := append([]string(nil), attributes...)
	return pushOption(func(pc *pushConfig) {
		pc.unwrapped = true
		pc.attrs = attrs
	})
}

// WithPushAuth makes [PushHandler] call verify on every request before it
// reads the body, and refuse the request when verify returns an error:
// with 403 when the error wraps [ErrPushForbidden], else with 401 (and a
// WWW-Authenticate: Bearer header). The error goes to the log (WARN), and
// the body is only the status text: a verifier's words may say what it
// expects (an account, an audience), which is no business of an
// unauthenticated sender. A verify that panics is a 500 with an ERROR
// line, never a dropped connection. A refused request never reaches the
// backend: nothing is claimed, nothing is run. The module
// github.com/gcp-pubsub-idempotency/idempotency/pushauth gives a verify
// that checks the OIDC token Pub/Sub puts on an authenticated push
// subscription's requests (its audience, issuer and service account); it
// is a module of its own so that this one does not depend on Google's API
// client. verify must be safe for concurrent use. PushHandler panics on a
// nil verify. [Idempotent] panics on this option, rather than run
// unauthenticated an endpoint meant to be authenticated: a function
// behind the functions framework is authenticated by Cloud Run itself
// (deploy it with authentication required; see docs/deploy.md).
func WithPushAuth(verify func(r *http.Request) error) Option {
	return pushOption(func(pc *pushConfig) {
		pc.auth = verify
		pc.authSet = true
	})
}

// PushHandler returns an http.Handler for a Cloud Run service (or any
// net/http server) that receives Pub/Sub deliveries without the functions
// framework. It accepts both shapes a push can have:
//
//   - a raw push envelope, as a push subscription posts it:
//     {"message": {...}, "subscription": "...", "deliveryAttempt": N};
//   - a CloudEvent, binary or structured, as Eventarc posts it;
//
// or, with [WithUnwrappedPush] (and only then), the unwrapped push of a
// subscription created with payload unwrapping.
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
//	key done with another payload            409              nack, retried
//	([ErrPayloadMismatch], see WithFingerprint)
//
// and, for requests the functions framework would answer itself:
//
//	malformed envelope or CloudEvent         400              nack, retried
//	not a POST                               405
//	body over MaxPushBody                    413
//
// and, with [WithPushAuth], for a request its verifier refuses:
//
//	no valid credential                      401              nack, retried
//	credential of a sender not allowed       403              nack, retried
//
// Only the guard's own outcomes ack (see Idempotent): a handler's error
// that wraps [ErrDuplicate] is a failure, answered 500.
//
// A raw envelope becomes a CloudEvent of type [PubSubEventType] whose id is
// the messageId and whose data is the envelope itself, so [ParsePubSub] sees
// the subscription and deliveryAttempt (which the functions framework's own
// conversion drops). An unwrapped push becomes the same CloudEvent, with an
// envelope built from its body and headers. A request that carries a
// [PushMessageIDHeader] without WithUnwrappedPush must be an envelope or a
// CloudEvent of that very message id; any other is refused with a 400 that
// names the option, rather than keyed on a body that is, most likely, an
// unwrapped payload. Errors are logged at ERROR, contention and refused
// requests at WARN, and the error text is the response body (but for
// WithPushAuth's refusals, whose body is the status text). PushHandler
// panics on what Idempotent panics on, and on a push option that is a
// mistake (see WithUnwrappedPush and WithPushAuth).
func PushHandler(b store.Backend, h CloudEventFunc, opts ...Option) http.Handler {
	return pushHandler("PushHandler", opts, func() CloudEventFunc { return idempotent("PushHandler", b, opts)(h) })
}

// pushHandler is the handler of PushHandler (fn, for panics) serving the
// guarded function that guard builds.
func pushHandler(fn string, opts []Option, guard func() CloudEventFunc) http.Handler {
	cfg := newConfig(opts)
	pc := newPushConfig(opts)
	if err := pc.validate(); err != nil {
		panic("idempotency." + fn + ": " + err.Error())
	}
	guarded := guard()
	log := cfg.lock.log()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			w.Header().Set("Allow", http.MethodPost)
			http.Error(w, "Pub/Sub push requests are POSTs", http.StatusMethodNotAllowed)
			return
		}
		if !authorized(w, r, pc.auth, log, "push") {
			return
		}
		var (
			e      event.Event
			status int
			err    error
		)
		if pc.unwrapped {
			e, status, err = unwrappedEvent(r, pc.attrs)
		} else {
			e, status, err = pushEvent(r)
		}
		if err != nil {
			log.WarnContext(r.Context(), "idempotency: refusing a push request", "status", status, "error", err)
			http.Error(w, err.Error(), status)
			return
		}
		// deliver sets spanCtx to the context with the delivery's span,
		// for the line below.
		ctx := requestTrace(r.Context(), r)
		spanCtx := ctx
		err = guarded(context.WithValue(ctx, pushSpanKey{}, &spanCtx), e)
		if err == nil {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		if pc.unwrapped && errors.Is(err, ErrNoKey) {
			err = unwrappedNoKey(err, e.Type() == PubSubEventType)
		}
		// The status the functions framework would write for err (see
		// wireStatus): Idempotent gives every failure a 4xx or 5xx.
		status = wireStatus(err)
		if status < 400 || status > 599 {
			status = http.StatusInternalServerError // never an ack for a failure
		}
		if status != http.StatusServiceUnavailable && !loggedMismatch(err) { // contention and mismatches were logged already
			log.ErrorContext(spanCtx, "idempotency: push delivery failed; nacking", "status", status,
				"event_id", e.ID(), "error", err)
		}
		http.Error(w, err.Error(), status)
	})
}

// authorized calls auth, when set, on r, and answers r itself when auth
// refuses it (see WithPushAuth): it reports whether r may go on. what
// names the request in the log ("push", "task").
func authorized(w http.ResponseWriter, r *http.Request, auth func(*http.Request) error, log *slog.Logger, what string) bool {
	if auth == nil {
		return true
	}
	if panicked, err := verify(auth, r); panicked {
		log.ErrorContext(r.Context(), "idempotency: the "+what+" verifier panicked; refusing the request", "status", http.StatusInternalServerError, "panic", err)
		http.Error(w, "the "+what+" verifier failed", http.StatusInternalServerError)
		return false
	} else if err != nil {
		status := http.StatusUnauthorized
		if errors.Is(err, ErrPushForbidden) {
			status = http.StatusForbidden
		} else {
			w.Header().Set("WWW-Authenticate", "Bearer")
		}
		log.WarnContext(r.Context(), "idempotency: refusing an unauthenticated "+what+" request", "status", status, "error", err)
		http.Error(w, http.StatusText(status), status)
		return false
	}
	return true
}

// pushSpanKey is the context key under which PushHandler passes deliver
// a *context.Context to set to the delivery's span context.
type pushSpanKey struct{}

// verify calls the push verifier, with a panic in it reported as
// panicked and its value as err: a verifier sees every request, an
// unauthenticated one included.
func verify(auth func(*http.Request) error, r *http.Request) (panicked bool, err error) {
	defer func() {
		if p := recover(); p != nil {
			panicked, err = true, fmt.Errorf("%v", p)
		}
	}()
	return false, auth(r)
}

// unwrappedNoKey adds to the ErrNoKey of an unwrapped push what can key
// it.
func unwrappedNoKey(err error, hasID bool) error {
	if hasID {
		return fmt.Errorf("%w: on an unwrapped push, an attribute reaches the key (and the handler) only when WithUnwrappedPush names it", err)
	}
	return fmt.Errorf("%w: the unwrapped push carries no %s header (its subscription was created without --push-no-wrapper-write-metadata), so the message id cannot be the key and only a key read from the payload can work, such as WithKey(JSONField(\"order\", \"id\")); the configured key found none", err, PushMessageIDHeader)
}

// unidentifiedPushType marks a raw push envelope, or an unwrapped push,
// without a message id.
const unidentifiedPushType = "io.github.gcp-pubsub-idempotency.push.unidentified"

// readBody reads the request body, up to MaxPushBody; a nil Body is an
// empty one. Its buffer grows
// towards the request's Content-Length, when it gives one, in at most
// three steps (io.ReadAll's growth would allocate about twice the body);
// but only as far as the bytes that arrived vouch for it: the first
// buffer is at most readAhead, and each next at most 4 times the last, so
// a request that claims 16 MiB and sends nothing costs 1 MiB.
func readBody(r *http.Request) ([]byte, int, error) {
	if r.Body == nil { // a client request served by ServeHTTP directly: no body
		return []byte{}, 0, nil
	}
	body, err := readAll(io.LimitReader(r.Body, MaxPushBody+1), r.ContentLength)
	if err != nil {
		return nil, http.StatusBadRequest, fmt.Errorf("reading the body: %w", err)
	}
	if len(body) > MaxPushBody {
		return nil, http.StatusRequestEntityTooLarge, fmt.Errorf("body over %d bytes", MaxPushBody)
	}
	return body, 0, nil
}

// readAhead is the most readBody allocates before any byte arrives.
const readAhead = 1 << 20

// readAll is io.ReadAll for a body that says it has size bytes (<= 0: it
// does not say); see readBody.
func readAll(r io.Reader, size int64) ([]byte, error) {
	want := 512 // what io.ReadAll starts with
	if size > 0 && size <= MaxPushBody {
		want = int(size) + 1 // +1: the read that finds EOF
	}
	b := make([]byte, 0, min(want, readAhead))
	for {
		if len(b) == cap(b) {
			if next := min(want, 4*cap(b)); next > cap(b) {
				b = append(make([]byte, 0, next), b...)
			} else {
				b = append(b, 0)[:len(b)] // past what the body said: as io.ReadAll
			}
		}
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return b, err
		}
	}
}

// bodyMessage is a CloudEvents HTTP message whose body was read already:
// a binary-mode event gets that body as its data, not a copy of it.
type bodyMessage struct {
	*cehttp.Message
	body []byte
}

// ReadBinary reads the headers as the SDK does, and gives w the body as
// a *bytes.Buffer, which the SDK's event builder keeps without copying.
func (m bodyMessage) ReadBinary(ctx context.Context, w binding.BinaryWriter) error {
	m.Message.BodyReader = nil
	if err := m.Message.ReadBinary(ctx, w); err != nil {
		return err
	}
	return w.SetData(bytes.NewBuffer(m.body))
}

// pushEvent reads the request as a CloudEvent or a raw push envelope. A
// request with a message id header must be that message's.
func pushEvent(r *http.Request) (event.Event, int, error) {
	e, status, err := wrappedEvent(r)
	ids, unwrapped := r.Header[PushMessageIDHeader]
	if !unwrapped || status == http.StatusRequestEntityTooLarge {
		return e, status, err
	}
	if err == nil {
		ev, perr := ParsePubSub(e)
		if len(ids) == 1 && perr == nil && ev.Message.ID == ids[0] {
			return e, 0, nil
		}
	}
	return event.Event{}, http.StatusBadRequest, fmt.Errorf("%w: the request carries the %s header of an unwrapped push (a subscription created with --push-no-wrapper), but it is not that message's envelope or CloudEvent; serve such a subscription with WithUnwrappedPush", ErrMalformedEvent, PushMessageIDHeader)
}

// wrappedEvent reads the request as a CloudEvent or a raw push envelope.
func wrappedEvent(r *http.Request) (event.Event, int, error) {
	body, status, err := readBody(r)
	if err != nil {
		return event.Event{}, status, err
	}
	if r.Header.Get("Ce-Id") != "" || strings.Contains(r.Header.Get("Content-Type"), "cloudevents") {
		msg := cehttp.NewMessage(r.Header, io.NopCloser(bytes.NewReader(body)))
		e, err := binding.ToEvent(r.Context(), bodyMessage{msg, body})
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
	e := pubsubEventFor(firstNonEmpty(env.Message.MessageID, env.Message.MessageIDAlt), env.Subscription, env.Message.PublishTime)
	setJSONData(&e, body)
	return e, 0, nil
}

// pubsubEventFor is the CloudEvent (without data) of the message id of
// the given subscription, published at publishTime (RFC 3339, ignored if
// not).
func pubsubEventFor(id, subscription, publishTime string) event.Event {
	e := event.New()
	e.SetType(PubSubEventType)
	e.SetID(id)
	if e.ID() == "" {
		// A CloudEvent needs an id, but this one must not become the key:
		// with a type other than PubSubEventType, MessageID finds no key and
		// the delivery fails closed.
		e.SetID("unidentified")
		e.SetType(unidentifiedPushType)
	}
	e.SetSource("//pubsub.googleapis.com/" + subscription)
	if t, err := time.Parse(time.RFC3339Nano, publishTime); err == nil {
		e.SetTime(t)
	}
	return e
}

// unwrappedEvent reads an unwrapped push: the body is the message data,
// the metadata and the named attributes are headers. The event's data is
// the envelope a wrapped push of the same message would have carried.
func unwrappedEvent(r *http.Request, attrs []string) (event.Event, int, error) {
	body, status, err := readBody(r)
	if err != nil {
		return event.Event{}, status, err
	}
	one := func(name string) (string, error) { return singleHeader(r.Header, name) }
	var msg struct {
		Data        []byte            `json:"data,omitempty"`
		Attributes  map[string]string `json:"attributes,omitempty"`
		MessageID   string            `json:"messageId,omitempty"`
		PublishTime string            `json:"publishTime,omitempty"`
		OrderingKey string            `json:"orderingKey,omitempty"`
	}
	msg.Data = body
	var sub string
	for _, f := range []struct {
		header string
		to     *string
	}{
		{PushMessageIDHeader, &msg.MessageID},
		{PushPublishTimeHeader, &msg.PublishTime},
		{PushSubscriptionHeader, &sub},
		{PushOrderingKeyHeader, &msg.OrderingKey},
	} {
		if *f.to, err = one(f.header); err != nil {
			return event.Event{}, http.StatusBadRequest, err
		}
	}
	for _, a := range attrs {
		v, err := one(a)
		if err != nil {
			return event.Event{}, http.StatusBadRequest, err
		}
		if _, ok := r.Header[http.CanonicalHeaderKey(a)]; ok {
			if msg.Attributes == nil {
				msg.Attributes = map[string]string{}
			}
			msg.Attributes[a] = v
		}
	}
	data, err := json.Marshal(struct {
		Message      any    `json:"message"`
		Subscription string `json:"subscription,omitempty"`
	}{msg, sub})
	if err != nil {
		return event.Event{}, http.StatusBadRequest, fmt.Errorf("%w: %v", ErrMalformedEvent, err)
	}
	e := pubsubEventFor(msg.MessageID, sub, msg.PublishTime)
	setJSONData(&e, data)
	return e, 0, nil
}

// singleHeader is the value of header name in h, "" when it is absent,
// or an error wrapping ErrMalformedEvent when it is repeated or not valid
// UTF-8: there is then no single value to key on.
func singleHeader(h http.Header, name string) (string, error) {
	vs := h.Values(name)
	switch {
	case len(vs) > 1:
		return "", fmt.Errorf("%w: header %s is repeated", ErrMalformedEvent, name)
	case len(vs) == 0:
		return "", nil
	case !utf8.ValidString(vs[0]):
		return "", fmt.Errorf("%w: header %s is not valid UTF-8", ErrMalformedEvent, name)
	}
	return vs[0], nil
}

// setJSONData makes data, valid JSON, e's data as it is: SetData would
// marshal a json.RawMessage, a compacted copy of it.
func setJSONData(e *event.Event, data []byte) {
	e.SetDataContentType(event.ApplicationJSON)
	e.DataEncoded = data
	e.DataBase64 = false
}
