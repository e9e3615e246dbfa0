// Package pullstandin stands in for the pull module (package pull) until
// its branch is merged: the same API, a minimal translation. It is removed
// by the merge; nothing but the storm's subscriber uses it.
package pullstandin

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"cloud.google.com/go/pubsub/v2"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"
	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/pubsubtest"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Func is the work for one pulled message; nil means done.
type Func = func(ctx context.Context, m *pubsub.Message) error

// TxFunc is the work for one pulled message inside the store's transaction.
type TxFunc[Tx any] = func(ctx context.Context, m *pubsub.Message, tx Tx) error

// Handler guards h with b and acks or nacks each message itself.
func Handler(sub *pubsub.Subscriber, b store.Backend, h Func, opts ...idempotency.Option) func(context.Context, *pubsub.Message) {
	return settle(sub, func(m *pubsub.Message) idempotency.CloudEventFunc {
		return idempotency.Idempotent(b, opts...)(func(ctx context.Context, _ event.Event) error { return h(ctx, m) })
	})
}

// HandlerTx is Handler with h run in the store's transaction.
func HandlerTx[Tx any](sub *pubsub.Subscriber, b store.TxBackend[Tx], h TxFunc[Tx], opts ...idempotency.Option) func(context.Context, *pubsub.Message) {
	return settle(sub, func(m *pubsub.Message) idempotency.CloudEventFunc {
		return idempotency.IdempotentTx(b, opts...)(func(ctx context.Context, _ event.Event, tx Tx) error { return h(ctx, m, tx) })
	})
}

func settle(sub *pubsub.Subscriber, guarded func(*pubsub.Message) idempotency.CloudEventFunc) func(context.Context, *pubsub.Message) {
	return func(ctx context.Context, m *pubsub.Message) {
		if sub != nil && sub.ReceiveSettings.MaxExtension > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, sub.ReceiveSettings.MaxExtension)
			defer cancel()
		}
		pm := &pubsubtest.Message{ID: m.ID, Data: m.Data, Attributes: m.Attributes, PublishTime: m.PublishTime}
		err := guarded(m)(ctx, pm.Event())
		var r *cehttp.Result
		switch {
		case err == nil:
			m.Ack()
		case errors.As(err, &r) && r.StatusCode/100 == 2:
			m.Ack()
		case errors.As(err, &r) && r.StatusCode == 503:
			select {
			case <-time.After(time.Duration(200+rand.IntN(800)) * time.Millisecond):
			case <-ctx.Done():
			}
			m.Nack()
		default:
			m.Nack()
		}
	}
}
