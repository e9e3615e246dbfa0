package idempotency

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// CloudEventFunc is the signature of a CloudEvent function, as
// functions.CloudEvent and funcframework.RegisterCloudEventFunctionContext
// take it.
type CloudEventFunc = func(context.Context, event.Event) error

// DisableEnv names the environment variable that turns Idempotent into a
// pass-through: set to 1, true, yes or on (any case), the handler runs
// unguarded and the backend is never called. It is meant for unit tests of
// a handler body; never set it in production, where a redelivery would then
// run the work again.
const DisableEnv = "GCP_PUBSUB_IDEMPOTENCY_DISABLED"

// ErrNoKey reports an event from which no key could be resolved. Idempotent
// refuses such an event (a nack) unless AllowUnguarded is set.
var ErrNoKey = errors.New("idempotency: event has no key")

type config struct {
	lock      lockConfig
	key       KeyFunc
	prefix    string
	unguarded bool
	onDup     func(context.Context, string) error
}

func newConfig(opts []Option) config {
	cfg := config{lock: newLockConfig(), key: MessageID()}
	for _, o := range opts {
		o.applyIdempotent(&cfg)
	}
	return cfg
}

type option func(*config)

func (f option) applyIdempotent(c *config) { f(c) }

// WithKey sets how Idempotent finds an event's key. The default is
// MessageID().
func WithKey(f KeyFunc) Option {
	return option(func(c *config) { c.key = f })
}

// WithKeyPrefix puts prefix in front of every resolved key, so that several
// handlers can share one backend without their keys meeting (for example
// "orders:" and "refunds:").
//
// A prefix is a name followed by one colon, and the name holds no colon
// ("orders:", "orders.refunds:", "orders-v2:"); Idempotent panics on any
// other prefix. The rule makes prefixed keys injective: the prefix is
// everything up to the first colon, so two handlers with different
// prefixes can never compose the same key. Without it, "orders:" and
// "orders:refunds:" would collide silently ("orders:" + "refunds:1" is
// "orders:refunds:" + "1") and one handler's work would suppress the
// other's. A handler with no prefix shares the key space with everyone:
// give every handler on a shared backend its own prefix. Changing a
// prefix changes every key: a redelivery of a message completed under the
// old prefix is not recognised and runs again, so change it only when no
// such redelivery can be pending (after the ttl, or with an idle
// subscription).
func WithKeyPrefix(prefix string) Option {
	return option(func(c *config) { c.prefix = prefix })
}

// validatePrefix checks the WithKeyPrefix rule: empty, or a non-empty name
// without a colon, then one colon.
func validatePrefix(prefix string) error {
	if prefix == "" {
		return nil
	}
	if err := store.ValidateKey(prefix); err != nil {
		return err
	}
	if i := strings.IndexByte(prefix, ':'); i <= 0 || i != len(prefix)-1 {
		return fmt.Errorf("prefix %q must be a name without a colon followed by one colon, such as \"orders:\" (prefixes that are prefixes of each other, like \"orders:\" and \"orders:refunds:\", would share keys)", prefix)
	}
	return nil
}

// AllowUnguarded makes Idempotent run the handler without a lock, with a
// warning, for an event that has no key. By default such an event is
// refused with an error wrapping ErrNoKey, so it is retried and reaches the
// subscription's dead-letter topic rather than running unguarded.
func AllowUnguarded() Option {
	return option(func(c *config) { c.unguarded = true })
}

// OnDuplicate sets a hook called with the key when a delivery is suppressed
// as a duplicate, for a metric or a log line. The delivery is acked whatever
// the hook does: an error it returns, or a panic, is logged and ignored.
func OnDuplicate(hook func(ctx context.Context, key string) error) Option {
	return option(func(c *config) { c.onDup = hook })
}

// Disabled reports whether DisableEnv is set to 1, true, yes or on.
func Disabled() bool {
	switch strings.ToLower(strings.TrimSpace(os.Getenv(DisableEnv))) {
	case "1", "true", "yes", "on":
		return true
	}
	return false
}

// Idempotent returns a decorator that makes a CloudEvent function an
// idempotent consumer of Pub/Sub push deliveries:
//
//	functions.CloudEvent("HandleOrder", idempotency.Idempotent(backend)(handleOrder))
//
// For each event it resolves the key (the Pub/Sub messageId unless WithKey
// says otherwise, behind WithKeyPrefix), runs the handler under Lock, and
// maps the outcome to what the functions framework puts on the wire:
//
//	handler returned nil                   nil              200, ack
//	duplicate (key done within the ttl)    nil              200, ack; handler not run
//	key held by a live lease elsewhere     503 result       503, nack; one warning log
//	handler's error wraps ErrInProgress    503 result       503, nack (e.g. an inner Mutex)
//	handler returned any other error       that error       500 (or its own 4xx/5xx), nack
//	no key (and no AllowUnguarded)         ErrNoKey         500, nack; handler not run
//	malformed event data                   ErrMalformedEvent 500, nack; handler not run
//	backend failed to claim                the wrapped error 500, nack; handler not run
//
// Only the guard's own outcomes ack. An error the handler returned is a
// failure even when it wraps ErrDuplicate (say, a nested Lock on a sub-key
// that is already done): the claim was released, so the delivery is
// nacked, OnDuplicate is not called, and the redelivery runs the handler
// again. A handler's error that carries a cloudevents HTTP result keeps
// its status only when that status is a 4xx or 5xx; any other (a 1xx, 2xx
// or 3xx, which the framework would write as an ack, or one outside
// 101..599) is wrapped in a 500 result, as is an error that is a protocol
// ACK receipt.
//
// The 503 is a cloudevents HTTP result (cehttp.NewResult) that wraps the
// *InProgressError, so errors.Is(err, ErrInProgress) holds for it. The
// warning carries the key, when the key frees, and the message's
// deliveryAttempt when the subscription has a dead-letter policy; for a
// handler's inner key it names both keys (key and message_key).
//
// If DisableEnv is set when Idempotent is called, it logs one warning and
// returns the handler unguarded: the backend is never called and
// duplicates run again, but a failing handler's error still goes out as a
// nack, as above. Otherwise Idempotent panics, when it is
// called, on a nil backend, a non-positive lease or settle timeout, a nil
// KeyFunc, or a prefix that breaks the WithKeyPrefix rule: these are mistakes in
// the program, found at start-up.
func Idempotent(b store.Backend, opts ...Option) func(CloudEventFunc) CloudEventFunc {
	cfg := newConfig(opts)
	if Disabled() {
		cfg.lock.log().Warn("idempotency: " + DisableEnv + " is set; handlers run unguarded and duplicates are NOT suppressed")
		return func(h CloudEventFunc) CloudEventFunc {
			if h == nil {
				panic("idempotency.Idempotent: nil handler")
			}
			return func(ctx context.Context, e event.Event) error {
				if err := h(ctx, e); err != nil {
					return nackable(nilSafe(err))
				}
				return nil
			}
		}
	}
	if b == nil {
		panic("idempotency.Idempotent: nil backend")
	}
	if err := cfg.lock.validate(); err != nil {
		panic("idempotency.Idempotent: " + err.Error())
	}
	if cfg.key == nil {
		panic("idempotency.Idempotent: nil KeyFunc")
	}
	if err := validatePrefix(cfg.prefix); err != nil {
		panic("idempotency.Idempotent: key prefix: " + err.Error())
	}
	return func(h CloudEventFunc) CloudEventFunc {
		if h == nil {
			panic("idempotency.Idempotent: nil handler")
		}
		return func(ctx context.Context, e event.Event) error {
			return cfg.deliver(ctx, b, h, e)
		}
	}
}

func (c *config) deliver(ctx context.Context, b store.Backend, h CloudEventFunc, e event.Event) error {
	key, err := c.key(e)
	if err != nil {
		return nackable(fmt.Errorf("idempotency: event %q: resolving the key: %w", e.ID(), err))
	}
	if key == "" {
		if !c.unguarded {
			return fmt.Errorf("%w: event %q (type %q); refusing to run it unguarded", ErrNoKey, e.ID(), e.Type())
		}
		c.lock.log().WarnContext(ctx, "idempotency: event has no key; running the handler unguarded (AllowUnguarded)",
			"event_id", e.ID(), "event_type", e.Type())
		if err := h(ctx, e); err != nil {
			return nackable(nilSafe(err))
		}
		return nil
	}
	key = c.prefix + key
	if err := store.ValidateKey(key); err != nil {
		// A custom KeyFunc's NUL byte, or a key that the prefix pushes past
		// store.MaxKeyLen: refused before the backend sees it.
		return fmt.Errorf("idempotency: event %q: key: %w", e.ID(), err)
	}
	ran, err := run(ctx, b, key, func(ctx context.Context) error { return h(ctx, e) }, &c.lock, false)
	if ran {
		return c.bodyOutcome(ctx, e, key, nilSafe(err))
	}
	return c.ownOutcome(ctx, e, key, err)
}
