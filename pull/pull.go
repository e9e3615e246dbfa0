package pull

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"time"

	"cloud.google.com/go/pubsub/v2"
	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/optview"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/wire"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Func is the work for one pulled message; nil means done. It must not
// call m.Ack or m.Nack: the callback of [Handler] does, after the
// outcome is settled with the store (see Handler).
type Func = func(ctx context.Context, m *pubsub.Message) error

// TxFunc is [Func] for a transactional backend: it runs inside the
// backend's transaction tx, which also marks the key done (see
// idempotency.IdempotentTx).
type TxFunc[Tx any] = func(ctx context.Context, m *pubsub.Message, tx Tx) error

// Timing of the callbacks. Tests shorten them.
var (
	// nackDelayMax bounds the wait before the nack of a message whose
	// key is held elsewhere; the wait is drawn between half of it and
	// all of it.
	nackDelayMax = time.Second
	// ackWait bounds the wait for an ack's result.
	ackWait = 5 * time.Second
)

// Handler returns the callback for sub.Receive that runs h at most once
// to completion per key, as [idempotency.Idempotent] runs a push
// subscriber's function:
//
//	err := sub.Receive(ctx, pull.Handler(sub, backend, handle, opts...))
//
// Each message becomes the CloudEvent a push subscription's delivery
// of it becomes (type [idempotency.PubSubEventType], id the message ID,
// data the push envelope with the message's data, attributes, ID,
// publish time and ordering key, sub's full name and the delivery
// attempt), which runs through Idempotent(b, opts...): so the key (the
// message ID unless [idempotency.WithKey] says otherwise), the prefix,
// hashed keys, payload fingerprints, telemetry, logging, OnDuplicate and
// [idempotency.DisableEnv] behave as on push. The callback then acks or
// nacks the message itself:
//
//	h returned nil, or duplicate          Ack (with its result: see below)
//	key held elsewhere (a 503 on push)    Nack after a wait of 0.5 to 1 s; WARN
//	h's error wraps ErrInProgress (503)   Nack after the same wait; WARN
//	no key, malformed (400), key the      Nack; ERROR
//	  port refuses (400)
//	key done with another payload (409)   Nack; ERROR
//	h's error, or the claim failed        Nack; ERROR
//
// A message Nacked for a 400 or a 409 is redelivered until the
// subscription's dead-letter policy moves it to the dead-letter topic
// after its max delivery attempts, or forever when there is none,
// exactly as a push subscription redelivers a 400.
//
// Pub/Sub redelivers a nacked message at once unless the subscription
// has a retry policy; so that a key held by another delivery does not
// spin between this process and the store, the callback waits before
// the Nack, for 0.5 to 1 s drawn at random (less when the callback's
// context ends), never for the holder's lease. The wait holds an
// outstanding-message slot ([pubsub.ReceiveSettings]
// MaxOutstandingMessages) that long, not for a lease. In production,
// give the subscription a retry policy (its minimum backoff) to space
// redeliveries further.
//
// h's context ends sub.ReceiveSettings.MaxExtension after the callback
// started (the client's default when sub is nil or its MaxExtension is
// 0: 60 minutes; no end when it is negative, which turns off the
// client's extension): the client extends the message's ack deadline
// until then, and stops after. Without [idempotency.WithHeartbeat] and
// WithLeaseFromDeadline, the lease ends it sooner when it is shorter
// (the default lease, 15 minutes, is): nothing renews the claim, so h
// is cancelled before its lease lapses rather than run on a claim
// another delivery may take. With [idempotency.WithLeaseFromDeadline]
// the claim's lease then ends with the extension (plus the settle
// timeout and the margin), so a redelivery after the client stopped
// extending finds the key free only once h has returned or its lease has
// lapsed, and the fence refuses the Complete of a body that overran it.
// The client counts MaxExtension from the message's receipt, which is
// earlier than the callback's start when the message waited for flow
// control. Set MaxExtension above the longest run of h, use
// [idempotency.WithHeartbeat] for long handlers, and keep
// MaxOutstandingMessages near what the process can run at once.
//
// The Ack is AckWithResult, whose result the callback awaits for at most
// five seconds: on a subscription with exactly-once delivery it is the
// server's answer; without, it is a success at once. An ack that fails
// (or whose result does not come in time) after h's work is done is
// logged at WARN: the key is done, so the message's redelivery is acked
// as a duplicate without running h again.
//
// h must not call m.Ack or m.Nack: the first of the message's Ack and
// Nack calls counts and later ones have no effect, so an Ack of h's own
// before it fails loses the message (its key is released, and no
// redelivery comes), and a Nack of h's own before it succeeds brings a
// redelivery that is acked as a duplicate. sub may be nil: the client's
// defaults then apply, and the envelope names no subscription. Handler
// panics on a nil h, and on what Idempotent panics on.
func Handler(sub *pubsub.Subscriber, b store.Backend, h Func, opts ...idempotency.Option) func(context.Context, *pubsub.Message) {
	if h == nil {
		panic("pull.Handler: nil handler")
	}
	guarded := idempotency.Idempotent(b, opts...)(func(ctx context.Context, _ event.Event) error {
		return h(ctx, messageOf(ctx))
	})
	return newReceiver(sub, opts).callback(guarded)
}

// HandlerTx is [Handler] for a transactional backend (see
// [idempotency.IdempotentTx]): the same messages, outcomes and options,
// with h run inside the backend's transaction that marks the key done,
// so that h's writes and the done mark commit together or not at all.
// It panics on what IdempotentTx panics on (AllowUnguarded among them);
// while [idempotency.DisableEnv] is set, every message is nacked, as
// IdempotentTx refuses to run a transactional handler without its
// transaction.
func HandlerTx[Tx any](sub *pubsub.Subscriber, b store.TxBackend[Tx], h TxFunc[Tx], opts ...idempotency.Option) func(context.Context, *pubsub.Message) {
	if h == nil {
		panic("pull.HandlerTx: nil handler")
	}
	guarded := idempotency.IdempotentTx(b, opts...)(func(ctx context.Context, _ event.Event, tx Tx) error {
		return h(ctx, messageOf(ctx), tx)
	})
	return newReceiver(sub, opts).callback(guarded)
}

// messageKey is the context key under which the callback passes the
// message to the guarded function.
type messageKey struct{}

func messageOf(ctx context.Context) *pubsub.Message {
	m, _ := ctx.Value(messageKey{}).(*pubsub.Message)
	return m
}

// receiver is what a callback knows of its subscription.
type receiver struct {
	subscription string
	maxExt       time.Duration // 0: no bound
	log          *slog.Logger
}

func newReceiver(sub *pubsub.Subscriber, opts []idempotency.Option) *receiver {
	view := optview.Of(opts)
	r := &receiver{maxExt: pubsub.DefaultReceiveSettings.MaxExtension, log: view.Logger}
	if sub != nil {
		r.subscription = sub.String()
		switch ext := sub.ReceiveSettings.MaxExtension; {
		case ext < 0:
			r.maxExt = 0
		case ext > 0:
			r.maxExt = ext
		}
	}
	// A lease nothing renews or sizes from the deadline bounds h too: the
	// claim is taken after the callback starts, so h's context ends before
	// the claim's lease does, and h never runs on a lapsed claim.
	if !view.FromDeadline && view.Heartbeat == 0 && (r.maxExt == 0 || view.Lease < r.maxExt) {
		r.maxExt = view.Lease
	}
	return r
}

// callback is the Receive callback that runs each message through
// guarded and acks or nacks it by the outcome.
func (r *receiver) callback(guarded idempotency.CloudEventFunc) func(context.Context, *pubsub.Message) {
	return func(ctx context.Context, m *pubsub.Message) {
		hctx := ctx
		if r.maxExt > 0 {
			var cancel context.CancelFunc
			hctx, cancel = context.WithTimeout(ctx, r.maxExt)
			defer cancel()
		}
		err := guarded(context.WithValue(hctx, messageKey{}, m), r.event(m))
		r.settle(ctx, m, err)
	}
}

// settle acks or nacks m by err, what the guarded function returned.
func (r *receiver) settle(ctx context.Context, m *pubsub.Message, err error) {
	// The status a push of m would go out with; Idempotent gives every
	// failure a 4xx or 5xx, and no failure may ack.
	status := wire.Status(err)
	if err != nil && (status < 400 || status > 599) {
		status = http.StatusInternalServerError
	}
	switch {
	case err == nil:
		r.ack(ctx, m)
	case status == http.StatusServiceUnavailable:
		// Logged (WARN) by the guard. Wait before the nack, so that a key
		// held elsewhere does not spin.
		wait(ctx, nackDelayMax/2+rand.N(nackDelayMax/2+1))
		m.Nack()
	case status == http.StatusConflict && errors.Is(err, idempotency.ErrPayloadMismatch):
		m.Nack() // logged (ERROR, with both fingerprints) by the guard
	case status == http.StatusBadRequest:
		r.log.ErrorContext(ctx, "idempotency: pulled message refused; nacking (it reaches the dead-letter topic after the max delivery attempts, or is redelivered forever without one)",
			append(r.attrs(m), "status", status, "error", err)...)
		m.Nack()
	default:
		r.log.ErrorContext(ctx, "idempotency: pulled message failed; nacking",
			append(r.attrs(m), "status", status, "error", err)...)
		m.Nack()
	}
}

// ack acks m and awaits the result, for at most ackWait.
func (r *receiver) ack(ctx context.Context, m *pubsub.Message) {
	res := m.AckWithResult()
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ackWait)
	defer cancel()
	st, err := res.Get(wctx)
	if err == nil && st == pubsub.AcknowledgeStatusSuccess {
		return
	}
	if err == nil {
		err = fmt.Errorf("acknowledge status %d", st)
	}
	r.log.WarnContext(ctx, "idempotency: the ack of a pulled message failed after its work was done; its key is done, so its redelivery will be acked as a duplicate without running the handler",
		append(r.attrs(m), "error", err)...)
}

// attrs are the log attributes of m.
func (r *receiver) attrs(m *pubsub.Message) []any {
	a := []any{"message_id", m.ID}
	if r.subscription != "" {
		a = append(a, "subscription", r.subscription)
	}
	if m.DeliveryAttempt != nil {
		a = append(a, "delivery_attempt", *m.DeliveryAttempt)
	}
	return a
}

// wait sleeps for d, or until ctx ends.
func wait(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// unidentifiedType is the type of the event of a message without an ID,
// which no server sends: the default key finds no key in it, so it is
// refused rather than keyed on a made-up ID.
const unidentifiedType = "io.github.gcp-pubsub-idempotency.pull.unidentified"

// event is the CloudEvent that a push subscription's delivery of m
// becomes (see idempotency.PushHandler).
func (r *receiver) event(m *pubsub.Message) event.Event {
	type message struct {
		Data        []byte            `json:"data,omitempty"`
		Attributes  map[string]string `json:"attributes,omitempty"`
		MessageID   string            `json:"messageId"`
		PublishTime string            `json:"publishTime,omitempty"`
		OrderingKey string            `json:"orderingKey,omitempty"`
	}
	env := struct {
		Message         message `json:"message"`
		Subscription    string  `json:"subscription,omitempty"`
		DeliveryAttempt int     `json:"deliveryAttempt,omitempty"`
	}{
		Message: message{
			Data:        m.Data,
			Attributes:  m.Attributes,
			MessageID:   m.ID,
			OrderingKey: m.OrderingKey,
		},
		Subscription: r.subscription,
	}
	if m.DeliveryAttempt != nil {
		env.DeliveryAttempt = *m.DeliveryAttempt
	}
	e := event.New()
	e.SetType(idempotency.PubSubEventType)
	e.SetID(m.ID)
	if m.ID == "" {
		e.SetID("unidentified")
		e.SetType(unidentifiedType)
	}
	e.SetSource("//pubsub.googleapis.com/" + r.subscription)
	if !m.PublishTime.IsZero() {
		e.SetTime(m.PublishTime)
		env.Message.PublishTime = m.PublishTime.UTC().Format(time.RFC3339Nano)
	}
	// Strings, bytes and an int never fail to encode (invalid UTF-8 is
	// replaced, as in a push envelope).
	e.DataEncoded, _ = json.Marshal(env)
	e.SetDataContentType(event.ApplicationJSON)
	return e
}
