package idempotency

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"reflect"

	"github.com/cloudevents/sdk-go/v2/event"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/wire"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// ownOutcome maps what the guard decided WITHOUT running the handler (run
// reported ran == false) to what the function returns: the only path on
// which a duplicate acks.
func (c *config) ownOutcome(ctx context.Context, e event.Event, key string, err error) error {
	switch own := err.(type) {
	case *DuplicateError:
		c.lock.log().InfoContext(ctx, "idempotency: duplicate delivery acknowledged; handler not run",
			"key", key, "event_id", e.ID())
		c.duplicate(ctx, key)
		return nil
	case *InProgressError:
		attrs := []any{"key", key, "event_id", e.ID()}
		if !own.Until.IsZero() {
			attrs = append(attrs, "until", own.Until)
		}
		c.lock.log().WarnContext(ctx, "idempotency: key in progress elsewhere; nacking for a later retry (503 on a push, 423 on a task, a delayed Nack on a pull)",
			append(attrs, deliveryAttrs(e)...)...)
		return withStatus(http.StatusServiceUnavailable, err)
	case *PayloadMismatchError:
		attrs := []any{"key", key, "event_id", e.ID(), "stored_fingerprint", own.Stored, "delivered_fingerprint", own.Delivered}
		if !own.Until.IsZero() {
			attrs = append(attrs, "until", own.Until)
		}
		c.lock.log().ErrorContext(ctx, "idempotency: the key was completed by a different payload; not a duplicate, handler not run; nacking (409 on a push or a task; it reaches the dead-letter topic, if the subscription has one)",
			append(attrs, deliveryAttrs(e)...)...)
		return withStatus(http.StatusConflict, err)
	}
	return refused(err)
}

// loggedMismatch reports whether err is ownOutcome's 409 for a payload
// mismatch, which it has logged with both fingerprints.
func loggedMismatch(err error) bool {
	se, ok := err.(*statusError)
	if !ok || se.status != http.StatusConflict {
		return false
	}
	_, ok = se.err.(*PayloadMismatchError)
	return ok
}

// refused returns a failure of the guard's own (the handler did not run)
// with the status it goes out with: 400 when the message itself is at
// fault (it has no key, its data is not a Pub/Sub envelope, or its key is
// one the port refuses), so that no one mistakes it for a fault of the
// service; otherwise (a backend that failed to claim, a KeyFunc's own
// error, a cancelled request) the 500 of a plain error. Both are nacks:
// see Idempotent.
func refused(err error) error {
	if errors.Is(err, ErrNoKey) || errors.Is(err, ErrMalformedEvent) || errors.Is(err, store.ErrInvalidKey) {
		return withStatus(http.StatusBadRequest, err)
	}
	return nackable(err)
}

// bodyOutcome maps what the handler returned (run reported ran == true,
// or the handler ran unguarded: then key is empty). The claim was
// completed if and only if err is nil; otherwise it was released, and the
// delivery must be nacked whatever err wraps: a nested Lock's ErrDuplicate
// is the handler failing, not this delivery being a duplicate. A handler
// error wrapping ErrInProgress (an inner Lock or Mutex found its key held)
// becomes a 503, which is still a nack, with a warning naming the inner
// key.
func (c *config) bodyOutcome(ctx context.Context, e event.Event, key string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, ErrInProgress) {
		msg := "idempotency: the handler found an inner key in progress elsewhere; released the message key, nacking for a later retry (503 on a push, 423 on a task, a delayed Nack on a pull)"
		attrs := []any{"message_key", key, "event_id", e.ID()}
		if key == "" { // the handler ran unguarded: there is no message key
			msg = "idempotency: the handler found an inner key in progress elsewhere; nacking for a later retry (503 on a push, 423 on a task, a delayed Nack on a pull)"
			attrs = []any{"event_id", e.ID()}
		}
		var ip *InProgressError
		if errors.As(err, &ip) && ip != nil && ip.Superseded && ip.Key == key && key != "" {
			// LockTx's own: the claim was superseded before the commit.
			msg = "idempotency: the claim on the message key was superseded before the handler's transaction committed; rolled back, nothing committed; nacking for a later retry (503 on a push, 423 on a task, a delayed Nack on a pull)"
			attrs = []any{"key", key, "event_id", e.ID()}
		} else if ip != nil {
			attrs = append(attrs, "key", ip.Key)
			if !ip.Until.IsZero() {
				attrs = append(attrs, "until", ip.Until)
			}
		}
		c.lock.log().WarnContext(ctx, msg, append(attrs, deliveryAttrs(e)...)...)
		return withStatus(http.StatusServiceUnavailable, err)
	}
	return nackable(err)
}

// deliveryAttrs are the log attributes of e's Pub/Sub delivery, when known.
func deliveryAttrs(e event.Event) []any {
	var attrs []any
	if ev, perr := ParsePubSub(e); perr == nil {
		if ev.DeliveryAttempt > 0 {
			attrs = append(attrs, "delivery_attempt", ev.DeliveryAttempt)
		}
		if ev.Subscription != "" {
			attrs = append(attrs, "subscription", ev.Subscription)
		}
	}
	return attrs
}

// nackable returns a failure as an error that goes on the wire with a
// status Pub/Sub nacks (4xx or 5xx). err is returned unchanged when it
// already does; otherwise it gets a 500 (errors.Is still sees through
// it), because the functions framework would write an ack: it writes the
// status of the first *cehttp.Result in the chain when it is within
// 101..599 (a 1xx becomes an implicit 200, and Pub/Sub counts 102, 200,
// 201, 202 and 204 as acks), 200 for a status outside that range, and 200
// for an error that is a protocol ACK receipt.
func nackable(err error) error {
	if s := wireStatus(err); s >= 400 && s <= 599 {
		return err
	}
	return withStatus(http.StatusInternalServerError, err)
}

// withStatus returns err with the HTTP status it goes out with.
func withStatus(status int, err error) error {
	return &statusError{status: status, err: err}
}

// statusError is an error with the status it goes out with. To errors.As
// with a **cehttp.Result target (which the functions framework and
// PushHandler use to find a status) it is a *cehttp.Result with that
// status, found before anything it wraps; to errors.Is and errors.As for
// any other target it is transparent, which a cehttp.NewResult(status,
// "%w", err) would not be (a *cehttp.Result has no Unwrap, and its Is
// compares only status codes with another result). Its message is err's.
type statusError struct {
	status int
	err    error
}

func (e *statusError) Error() string { return fmt.Sprint(e.err) }

func (e *statusError) Unwrap() error { return e.err }

func (e *statusError) As(target any) bool {
	if r, ok := target.(**cehttp.Result); ok {
		*r = &cehttp.Result{StatusCode: e.status, Format: "%w", Args: []any{e.err}}
		return true
	}
	return false
}

// wireStatus is the status that goes on the wire for what Idempotent's
// function returned: the one mapping from an outcome to a status (see
// wire.Status), what the functions framework writes for a function's
// return value (200 for nil), and what PushHandler writes (with 204 for
// the ack).
func wireStatus(err error) int { return wire.Status(err) }

// duplicate calls the on-duplicate hook; nothing it does changes the ack.
func (c *config) duplicate(ctx context.Context, key string) {
	if c.onDup == nil {
		return
	}
	defer func() {
		if p := recover(); p != nil {
			c.lock.log().ErrorContext(ctx, "idempotency: on-duplicate hook panicked; ignored",
				"key", key, "panic", fmt.Sprint(p))
		}
	}()
	if err := c.onDup(ctx, key); err != nil {
		c.lock.log().ErrorContext(ctx, "idempotency: on-duplicate hook failed; ignored", "key", key, "error", err)
	}
}

// nilSafe returns err, or, when err is a non-nil error holding a nil
// pointer (a handler's "var e *MyError; return e"), an error that says so
// and wraps it. Such an error is a failure like any other, but calling its
// Error method may panic (in a log line, in the response body), and a
// panic there would crash the request instead of nacking it.
func nilSafe(err error) error {
	if err == nil {
		return nil
	}
	switch v := reflect.ValueOf(err); v.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan, reflect.Interface:
		if v.IsNil() {
			return &nilValueError{err: err}
		}
	}
	return err
}

// nilValueError is a handler's error that holds a nil pointer.
type nilValueError struct{ err error }

func (e *nilValueError) Error() string {
	return fmt.Sprintf("idempotency: the handler returned a nil %T as its error", e.err)
}

func (e *nilValueError) Unwrap() error { return e.err }
