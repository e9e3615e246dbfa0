package idempotency

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/cloudevents/sdk-go/v2/event"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"
)

// outcome maps the result of a guarded delivery to what the handler returns
// to the functions framework, and so to the HTTP status Pub/Sub sees.
func (c *config) outcome(ctx context.Context, e event.Event, key string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ErrDuplicate):
		c.lock.log().InfoContext(ctx, "idempotency: duplicate delivery acknowledged; handler not run",
			"key", key, "event_id", e.ID())
		c.duplicate(ctx, key)
		return nil
	case errors.Is(err, ErrInProgress):
		attrs := []any{"key", key, "event_id", e.ID()}
		var ip *InProgressError
		if errors.As(err, &ip) && !ip.Until.IsZero() {
			attrs = append(attrs, "until", ip.Until)
		}
		if ev, perr := ParsePubSub(e); perr == nil {
			if ev.DeliveryAttempt > 0 {
				attrs = append(attrs, "delivery_attempt", ev.DeliveryAttempt)
			}
			if ev.Subscription != "" {
				attrs = append(attrs, "subscription", ev.Subscription)
			}
		}
		c.lock.log().WarnContext(ctx, "idempotency: key in progress elsewhere; nacking with 503 for a later retry", attrs...)
		return InProgressResult(err)
	}
	return err
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
