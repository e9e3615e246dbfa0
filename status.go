package idempotency

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"reflect"

	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/cloudevents/sdk-go/v2/protocol"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"
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
		c.lock.log().WarnContext(ctx, "idempotency: key in progress elsewhere; nacking with 503 for a later retry",
			append(attrs, deliveryAttrs(e)...)...)
		return InProgressResult(err)
	}
	return nackable(err)
}

// bodyOutcome maps what the handler returned (run reported ran == true).
// The claim was completed if and only if err is nil; otherwise it was
// released, and the delivery must be nacked whatever err wraps: a nested
// Lock's ErrDuplicate is the handler failing, not this delivery being a
// duplicate. A handler error wrapping ErrInProgress (an inner Lock or
// Mutex found its key held) becomes a 503, which is still a nack, with a
// warning naming the inner key.
func (c *config) bodyOutcome(ctx context.Context, e event.Event, key string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, ErrInProgress) {
		attrs := []any{"message_key", key, "event_id", e.ID()}
		var ip *InProgressError
		if errors.As(err, &ip) && ip != nil {
			attrs = append(attrs, "key", ip.Key)
			if !ip.Until.IsZero() {
				attrs = append(attrs, "until", ip.Until)
			}
		}
		c.lock.log().WarnContext(ctx, "idempotency: the handler found an inner key in progress elsewhere; released the message key, nacking with 503 for a later retry",
			append(attrs, deliveryAttrs(e)...)...)
		return InProgressResult(err)
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
// already does; otherwise it is wrapped in a 500 result (errors.Is still
// sees through it), because the functions framework would write an ack:
// it writes the status of the first *cehttp.Result in the chain when it is
// within 101..599 (a 1xx becomes an implicit 200, and Pub/Sub counts 102,
// 200, 201, 202 and 204 as acks), 200 for a status outside that range, and
// 200 for an error that is a protocol ACK receipt.
func nackable(err error) error {
	if s := wireStatus(err); s >= 400 && s <= 599 {
		return err
	}
	return &nackError{err: err}
}

// nackError is a failure whose own status would ack. To errors.As (which
// the framework and PushHandler use to find a status) it is a 500
// *cehttp.Result, found before anything it wraps; to errors.Is and
// errors.As for any other target it is transparent, which a
// cehttp.NewResult(500, "%w", err) would not be (a *cehttp.Result has no
// Unwrap, and its Is compares only status codes with another result).
type nackError struct{ err error }

func (e *nackError) Error() string { return fmt.Sprint(e.err) }

func (e *nackError) Unwrap() error { return e.err }

func (e *nackError) As(target any) bool {
	if r, ok := target.(**cehttp.Result); ok {
		*r = &cehttp.Result{StatusCode: http.StatusInternalServerError, Format: "%w", Args: []any{e.err}}
		return true
	}
	return false
}

// wireStatus is the status the functions framework (cloudevents sdk-go
// v2.16) writes for a function that returned err != nil; 0 for a nil
// *cehttp.Result, on which it would panic.
func wireStatus(err error) int {
	var res *cehttp.Result
	switch {
	case errors.As(err, &res):
		switch {
		case res == nil:
			return 0
		case res.StatusCode > 100 && res.StatusCode < 600:
			return res.StatusCode
		}
		return http.StatusOK
	case protocol.IsACK(err):
		return http.StatusOK
	}
	return http.StatusInternalServerError
}

// InProgressResult wraps err in a cloudevents HTTP result with status 503
// Service Unavailable, which the functions framework writes as the response
// status: Pub/Sub takes it as a nack and redelivers later. errors.Is still
// sees through it to err.
func InProgressResult(err error) error {
	return cehttp.NewResult(http.StatusServiceUnavailable, "%w", err)
}

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
