package idempotency

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"

	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// CloudEventFunc is the signature of a CloudEvent function, as
// functions.CloudEvent and funcframework.RegisterCloudEventFunctionContext
// take it.
type CloudEventFunc = func(context.Context, event.Event) error

// DisableEnv names the environment variable that turns [Idempotent] into a
// pass-through: set to 1, true, yes or on (any case), the handler runs
// unguarded and the backend is never called. It is meant for unit tests of
// a handler body; never set it in production, where a redelivery would then
// run the work again.
const DisableEnv = "GCP_PUBSUB_IDEMPOTENCY_DISABLED"

// ErrNoKey reports an event from which no key could be resolved.
// [Idempotent] refuses such an event with a 400 that Pub/Sub redelivers
// (see [Idempotent] for why 400), unless [AllowUnguarded] is set.
var ErrNoKey = errors.New("idempotency: event has no key")

// disabled reports whether DisableEnv is set to 1, true, yes or on.
func disabled() bool {
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
// For each event it resolves the key (the Pub/Sub messageId unless
// [WithKey] says otherwise, behind [WithKeyPrefix]), runs the handler
// under [Lock], and maps the outcome to what the functions framework puts
// on the wire ([PushHandler] writes the same statuses):
//
//	handler returned nil                   nil               200, ack
//	duplicate (key done within the ttl)    nil               200, ack; handler not run
//	key done with a different payload      409 result        409, nack; handler not run;
//	  (see WithFingerprint)                                  one ERROR log, both fingerprints
//	key held by a live lease elsewhere     503 result        503, nack; one warning log
//	handler's error wraps ErrInProgress    503 result        503, nack (e.g. an inner Mutex)
//	handler returned any other error       that error        500 (or its own 4xx/5xx), nack
//	no key (and no AllowUnguarded)         400 result        400, nack; handler not run
//	malformed event data                   400 result        400, nack; handler not run
//	key the port refuses                   400 result        400, nack; handler not run
//	  (with WithHashedKeys: stored hashed, as any key)
//	backend failed to claim                the wrapped error 500, nack; handler not run
//
// A result is an error in which the framework finds, with errors.As, a
// cloudevents *http.Result carrying the status; errors.Is and errors.As
// see through it to what it wraps: [ErrNoKey], [ErrMalformedEvent],
// [store.ErrInvalidKey], an *[InProgressError] ([ErrInProgress]), a
// *[PayloadMismatchError] ([ErrPayloadMismatch]).
//
// Why a payload mismatch is a 409: the message is not a duplicate, and
// acking it would lose it; it cannot run either, since its key is done.
// Like every non-ack it is redelivered until the dead-letter policy moves
// it aside, where someone can look at it. 409 Conflict says what happened
// (the delivery conflicts with the key's completed record) and, as a 4xx,
// that it is the message, not the service, that is at fault.
//
// Why an unkeyed or malformed event is a 400 and not a 500: Pub/Sub
// redelivers every status other than 102, 200, 201, 202 and 204 alike, so
// either way the message is nacked and kept, never lost (it fails closed),
// until the subscription's dead-letter policy moves it aside. The status is
// for people and monitoring: it is the message that is wrong, not the
// service, so it must not look like a server fault.
//
// Only the guard's own outcomes ack. An error the handler returned is a
// failure even when it wraps [ErrDuplicate] (say, a nested Lock on a
// sub-key that is already done): the claim was released, so the delivery
// is nacked, [OnDuplicate] is not called, and the redelivery runs the
// handler again. A handler's error that carries a cloudevents HTTP result
// keeps its status only when that status is a 4xx or 5xx; any other (a
// 1xx, 2xx or 3xx, which the framework would write as an ack, or one
// outside 101..599) becomes a 500 result, as does an error that is a
// protocol ACK receipt.
//
// The 503's warning carries the key, when the key frees, and the message's
// deliveryAttempt when the subscription has a dead-letter policy; for a
// handler's inner key it names both keys (key and message_key).
//
// [DisableEnv] is read on every delivery, so setting it in TestMain or
// with t.Setenv works wherever Idempotent was called. While it is set,
// the handler runs unguarded and the backend is never called: duplicates
// run again, but a failing handler's error still goes out as a nack, as
// above. A wrapped handler logs one warning each time it finds the switch
// set after finding it unset (or on its first delivery).
//
// Idempotent panics, when it is called, on a nil backend (unless
// DisableEnv is set then: a delivery that finds it unset later is refused
// with a 500, a nack), a lease, settle timeout or heartbeat below its
// floor ([MinLease], [MinSettleTimeout], [MinHeartbeat]; zero and
// negative included), a heartbeat not shorter than the lease, a negative
// [WithLeaseFromDeadline] margin, a
// nil [KeyFunc], a prefix that breaks the [WithKeyPrefix] rule, or
// [WithPushAuth] (an option of PushHandler only: behind the functions
// framework there is no request to verify, and ignoring it would leave
// unauthenticated an endpoint its author meant to authenticate): these
// are mistakes in the program, found at start-up. Built in a Cloud Run
// service or function (K_SERVICE set) on a backend that keeps its records
// in the process (one whose InProcess method reports true, as
// [fake.Store]'s does), it logs a warning: each instance would suppress
// only its own duplicates.
func Idempotent(b store.Backend, opts ...Option) func(CloudEventFunc) CloudEventFunc {
	refusePushOptions("Idempotent", opts)
	return idempotent("Idempotent", b, opts)
}

// refusePushOptions panics, for fn (a wrapper behind the functions
// framework), on an option of PushHandler only.
func refusePushOptions(fn string, opts []Option) {
	if newPushConfig(opts).authSet {
		panic("idempotency." + fn + ": WithPushAuth is an option of PushHandler only; a function behind the functions framework is authenticated by Cloud Run (deploy it with authentication required: see docs/deploy.md)")
	}
}

// idempotent is Idempotent without the refusal of PushHandler's options,
// for PushHandler; fn names the caller in panics.
func idempotent(fn string, b store.Backend, opts []Option) func(CloudEventFunc) CloudEventFunc {
	cfg := newGuardConfig(fn, b, opts)
	return func(h CloudEventFunc) CloudEventFunc {
		if h == nil {
			panic("idempotency." + fn + ": nil handler")
		}
		return cfg.guard(b, h, nil)
	}
}

// newGuardConfig builds and checks the configuration of a wrapper made by
// fn (its name, for panics) on b.
func newGuardConfig(fn string, b store.Backend, opts []Option) *config {
	cfg := newConfig(opts)
	if b == nil && !disabled() {
		panic("idempotency." + fn + ": nil backend")
	}
	if err := cfg.validate(); err != nil {
		panic("idempotency." + fn + ": " + err.Error())
	}
	if _, ok := b.(store.Fingerprinter); b != nil && !ok && cfg.fingerprint != nil {
		cfg.lock.log().Warn("idempotency: payload fingerprints are neither stored nor compared: the backend does not implement store.Fingerprinter; a key done by another payload is taken for a duplicate",
			"backend", fmt.Sprintf("%T", b))
	}
	if p, ok := b.(interface{ InProcess() bool }); ok && p.InProcess() && os.Getenv("K_SERVICE") != "" {
		cfg.lock.log().Warn("idempotency: the backend keeps its records in this process's memory, and this is a Cloud Run service: each instance de-duplicates only its own deliveries, and a restart forgets them all; use a shared backend (docs/backends.md)",
			"backend", fmt.Sprintf("%T", b), "service", os.Getenv("K_SERVICE"))
	}
	return &cfg
}

// guard is the wrapped handler: h on the plain path, or, when txOf is
// set, the transactional handler that txOf binds to an event (h is then
// nil: such a handler cannot run without its backend's transaction).
func (c *config) guard(b store.Backend, h CloudEventFunc, txOf func(event.Event) txFunc) CloudEventFunc {
	var warned atomic.Bool // warned since DisableEnv was last seen unset
	return func(ctx context.Context, e event.Event) error {
		// PushHandler's out-parameter for the delivery's span context
		// belongs to this call alone: the handler's context no longer
		// carries it, so that a delivery the handler runs with that
		// context (nested, in parallel, or after this call returned)
		// cannot write it.
		spanOut, _ := ctx.Value(pushSpanKey{}).(*context.Context)
		if spanOut != nil {
			ctx = context.WithValue(ctx, pushSpanKey{}, (*context.Context)(nil))
		}
		if disabled() {
			if txOf != nil {
				return nackable(fmt.Errorf("%s event %q: %s is set, and a transactional handler cannot run without its backend's transaction; nacking", errPrefix, e.ID(), DisableEnv))
			}
			if !warned.Swap(true) {
				c.lock.log().WarnContext(ctx, "idempotency: "+DisableEnv+" is set; handlers run unguarded and duplicates are NOT suppressed",
					"event_id", e.ID())
			}
			return c.bodyOutcome(ctx, e, "", nilSafe(h(ctx, e)))
		}
		if warned.Load() {
			warned.Store(false)
		}
		if b == nil {
			return nackable(fmt.Errorf("%s event %q: nil backend (%s was set when the wrapper was built, and is not now); refusing to run the handler unguarded", errPrefix, e.ID(), DisableEnv))
		}
		return c.deliver(ctx, b, h, txOf, e, spanOut)
	}
}

// deliver runs one guarded delivery of e; when spanOut is set (by
// PushHandler), it sets *spanOut to the context with the delivery's span.
func (c *config) deliver(ctx context.Context, b store.Backend, h CloudEventFunc, txOf func(event.Event) txFunc, e event.Event, spanOut *context.Context) error {
	if c.msgTrace {
		ctx = messageTrace(ctx, e)
	}
	key, fp, fpDone, err := c.keyAndFingerprint(e)
	if r, ok := err.(*refusedKeyError); ok && c.hashKeys {
		key, err = r.key, nil // stored hashed below
	}
	if err != nil {
		return refused(keyError(e, err))
	}
	if key == "" {
		if !c.unguarded {
			return refused(noKeyError(e))
		}
		c.lock.log().WarnContext(ctx, "idempotency: event has no key; running the handler unguarded (AllowUnguarded)",
			"event_id", e.ID(), "event_type", e.Type())
		return c.bodyOutcome(ctx, e, "", nilSafe(h(ctx, e)))
	}
	found := key
	key = c.storedKey(key)
	if err := store.ValidateKey(key); err != nil {
		// A custom KeyFunc's NUL byte, or a key that the prefix pushes past
		// store.MaxKeyLen: refused before the backend sees it.
		hint := " (WithHashedKeys stores such keys hashed)"
		if c.hashKeys {
			hint = " (the key prefix is too long for a hashed key)"
		}
		return refused(fmt.Errorf("idempotency: event %q: key%s: %w", e.ID(), hint, err))
	}
	if !fpDone {
		if fp, err = c.fingerprintOf(e); err != nil {
			return refused(err)
		}
	}
	// The lines logged about this delivery name the call's span, as the
	// handler's own lines do; PushHandler's too (pushSpan).
	var run body
	if txOf != nil {
		run.tx = txOf(e)
	} else {
		run.fn = func(ctx context.Context) error { return h(ctx, e) }
	}
	o := delivery{b: b, key: key, found: found, fp: fp, cfg: &c.lock}.run(ctx, run)
	if spanOut != nil {
		*spanOut = o.ctx
	}
	ctx, err = o.ctx, o.err
	if o.ran {
		return c.bodyOutcome(ctx, e, key, nilSafe(err))
	}
	return c.ownOutcome(ctx, e, key, err)
}

// noKeyError is the refusal of an unkeyed event: it names the options
// that key such an event, or let it run unguarded.
func noKeyError(e event.Event) error {
	why := ""
	if e.Type() != PubSubEventType {
		why = " it is not a Pub/Sub message, which the default key (MessageID) needs;"
	}
	return fmt.Errorf("%w: event %q (type %q);%s key it with WithKey(JSONField(...)), WithKey(Attribute(...)) or a KeyFunc of your own, or allow it with AllowUnguarded; refusing to run it unguarded",
		ErrNoKey, e.ID(), e.Type(), why)
}

// storedKey is key as the backend stores it: behind the prefix, and
// hashed with WithHashedKeys when the port would refuse it or it could be
// mistaken for a hashed key.
func (c *config) storedKey(key string) string {
	full := c.prefix + key
	if !c.hashKeys || (store.ValidateKey(full) == nil && !strings.HasPrefix(key, HashedKeyPrefix)) {
		return full
	}
	return c.prefix + hashKey(key)
}

// hashKey returns HashedKeyPrefix and the hex SHA-256 of key.
func hashKey(key string) string {
	sum := sha256.Sum256([]byte(key))
	return HashedKeyPrefix + hex.EncodeToString(sum[:])
}

// keyError is a KeyFunc's error as Idempotent returns it: as is when it
// already speaks for this package (the KeyFuncs here, and errors wrapping
// its sentinels, name the event themselves), else behind the package
// prefix and the event's id, so that no message says "idempotency:" twice.
func keyError(e event.Event, err error) error {
	if strings.Contains(fmt.Sprint(err), errPrefix) {
		return err
	}
	return fmt.Errorf(errPrefix+" event %q: resolving the key: %w", e.ID(), err)
}

// errPrefix starts every error message of this package, once.
const errPrefix = "idempotency:"
