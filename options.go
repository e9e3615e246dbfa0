package idempotency

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Every option is a value that sets one field of a configuration built
// afresh for each call that takes options ([Idempotent], [PushHandler],
// [Lock], [Mutex]): an option never holds or shares a configuration, so
// applying one twice, or to several calls, is safe.

// Option configures [Idempotent] and [PushHandler]. The options of this
// package are its only implementations.
type Option interface {
	applyIdempotent(*config)
}

// LockOption configures [Lock] and [Mutex]. Every LockOption is also an
// [Option] for [Idempotent] and [PushHandler].
type LockOption interface {
	Option
	applyLock(*lockConfig)
}

// DefaultSettleTimeout bounds the Complete or Release call that follows the
// body. That call runs on a context detached from the caller's cancellation,
// so a request that ends the moment the work ends still records the outcome.
const DefaultSettleTimeout = 10 * time.Second

// The floors of the durations the options set: a shorter one cannot work,
// and [Lock] and [Mutex] return an error, and [Idempotent] and
// [PushHandler] panic, as they do for a zero or negative one.
const (
	// MinLease is the shortest lease [WithLease] accepts. A claim must
	// outlast its own round trip to the store and the start of its body:
	// a lease shorter than that lapses before the body runs, and any
	// other delivery may take the key beside it. 100 ms is a few round
	// trips to the slowest of this module's stores (a Spanner commit),
	// and the least a lease needs to be of to be renewed at all (it must
	// exceed MinHeartbeat).
	MinLease = 100 * time.Millisecond
	// MinSettleTimeout is the shortest settle timeout
	// [WithSettleTimeout] accepts: the Complete or Release after the
	// body must have time to reach the store and come back. With less
	// (1 ns on main), Complete was never attempted: Lock returned nil,
	// the key stayed claimed, and a redelivery after the lease ran the
	// work again. 100 ms leaves one round trip to any of this module's
	// stores and a retry after the first backoff (20 ms).
	MinSettleTimeout = 100 * time.Millisecond
	// MinHeartbeat is the shortest interval [WithHeartbeat] accepts.
	// Each renewal is a write to the store, at most one in flight: at 1
	// ns the renewals ran back to back, over a million a second against
	// the fake store. 100 ms bounds them at ten a second per running
	// body, against leases that are seconds to minutes long.
	MinHeartbeat = 100 * time.Millisecond
)

// config is what the options of Idempotent set.
type config struct {
	lock      lockConfig
	key       KeyFunc
	prefix    string
	unguarded bool
	onDup     func(context.Context, string) error
	hashKeys  bool
	msgTrace  bool // WithTraceFromMessage (telemetry.go)
	// fingerprint fingerprints each delivery's payload; nil means none.
	fingerprint FingerprintFunc
}

// newConfig returns the defaults with opts applied, in order.
func newConfig(opts []Option) config {
	cfg := config{lock: newLockConfig(), key: DefaultKey(), fingerprint: defaultFingerprint}
	for _, o := range opts {
		o.applyIdempotent(&cfg)
	}
	return cfg
}

// validate reports the first setting that is a mistake in the program.
func (c *config) validate() error {
	if err := c.lock.validate(); err != nil {
		return err
	}
	if c.key == nil {
		return fmt.Errorf("nil KeyFunc")
	}
	if err := validatePrefix(c.prefix); err != nil {
		return fmt.Errorf("key prefix: %w", err)
	}
	return nil
}

// lockConfig is what the options of Lock and Mutex set.
type lockConfig struct {
	lease     time.Duration
	settle    time.Duration
	heartbeat time.Duration
	logger    *slog.Logger

	// fromDeadline sizes each claim's lease from ctx's deadline (see
	// WithLeaseFromDeadline), with margin on top.
	fromDeadline bool
	margin       time.Duration
	// now reads the clock against which ctx's deadline is measured; nil
	// means time.Now. Tests inject one.
	now func() time.Time
	// tel is where spans and metrics go (telemetry.go).
	tel telemetryConfig

	// fingerprint is Lock's payload fingerprint (WithPayloadFingerprint).
	fingerprint string
}

// newLockConfig returns the defaults with opts applied, in order.
func newLockConfig(opts ...LockOption) lockConfig {
	cfg := lockConfig{lease: store.DefaultLease, settle: DefaultSettleTimeout}
	for _, o := range opts {
		o.applyLock(&cfg)
	}
	return cfg
}

func (c *lockConfig) log() *slog.Logger {
	if c.logger != nil {
		return c.logger
	}
	return slog.Default()
}

// validate reports a lease, settle timeout or heartbeat that cannot work.
// Its errors carry no package prefix: the caller adds one.
func (c *lockConfig) validate() error {
	if err := store.ValidateLease(c.lease); err != nil {
		return err
	}
	if c.lease < MinLease {
		return fmt.Errorf("%w: %v is shorter than MinLease (%v)", store.ErrInvalidLease, c.lease, MinLease)
	}
	if c.settle <= 0 {
		return fmt.Errorf("settle timeout %v is not positive", c.settle)
	}
	if c.settle < MinSettleTimeout {
		return fmt.Errorf("settle timeout %v is shorter than MinSettleTimeout (%v): Complete would have no time to reach the store", c.settle, MinSettleTimeout)
	}
	if c.heartbeat < 0 || (c.heartbeat > 0 && c.heartbeat >= c.lease) {
		return fmt.Errorf("heartbeat %v must be positive and shorter than the lease %v", c.heartbeat, c.lease)
	}
	if c.heartbeat > 0 && c.heartbeat < MinHeartbeat {
		return fmt.Errorf("heartbeat %v is shorter than MinHeartbeat (%v)", c.heartbeat, MinHeartbeat)
	}
	if c.margin < 0 {
		return fmt.Errorf("lease margin %v is negative", c.margin)
	}
	return nil
}

type option func(*config)

func (f option) applyIdempotent(c *config) { f(c) }

type lockOption func(*lockConfig)

func (f lockOption) applyLock(c *lockConfig)   { f(c) }
func (f lockOption) applyIdempotent(c *config) { f(&c.lock) }

// WithKey sets how [Idempotent] finds an event's key. The default is
// [DefaultKey](): the messageId of a Pub/Sub message, the source and id
// of any other event.
func WithKey(f KeyFunc) Option {
	return option(func(c *config) { c.key = f })
}

// WithKeyPrefix puts prefix in front of every resolved key, so that several
// handlers can share one backend without their keys meeting (for example
// "orders:" and "refunds:").
//
// A prefix is a name followed by one colon, and the name holds no colon
// ("orders:", "orders.refunds:", "orders-v2:"); [Idempotent] panics on any
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

// AllowUnguarded makes [Idempotent] run the handler without a lock, with a
// warning, for an event that has no key. By default such an event is
// refused with an error wrapping [ErrNoKey], so it is retried and reaches
// the subscription's dead-letter topic rather than running unguarded.
func AllowUnguarded() Option {
	return option(func(c *config) { c.unguarded = true })
}

// OnDuplicate sets a hook called with the key when a delivery is suppressed
// as a duplicate, for a metric or a log line. The delivery is acked whatever
// the hook does: an error it returns, or a panic, is logged and ignored.
func OnDuplicate(hook func(ctx context.Context, key string) error) Option {
	return option(func(c *config) { c.onDup = hook })
}

// WithLease sets the lease of each claim: how long the holder owns the key
// before another delivery may take it over. It must exceed the longest run
// of the guarded work. The default is [store.DefaultLease] (15 minutes). A
// lease shorter than [MinLease] (100 ms; zero and negative included) makes
// [Lock] and [Mutex] return an error wrapping [store.ErrInvalidLease], and
// makes [Idempotent] panic. Any longer lease is honoured, up to
// math.MaxInt64 (see [store.ValidateLease]).
func WithLease(d time.Duration) LockOption {
	return lockOption(func(c *lockConfig) { c.lease = d })
}

// WithLogger sets where warnings and errors go. The default is
// [slog.Default]() at the time of the call.
func WithLogger(l *slog.Logger) LockOption {
	return lockOption(func(c *lockConfig) { c.logger = l })
}

// WithSettleTimeout bounds the Complete or Release call after the body
// (a failing call is retried within it). The default is
// [DefaultSettleTimeout]. A timeout shorter than [MinSettleTimeout]
// (100 ms; zero and negative included) makes [Lock] and [Mutex] return
// an error, and [Idempotent] panic: the call after the body would have no
// time to reach the store.
func WithSettleTimeout(d time.Duration) LockOption {
	return lockOption(func(c *lockConfig) { c.settle = d })
}

// WithHeartbeat renews the lease every interval while the body runs, on
// backends that implement [store.Extender] (all of this module's do), so
// work that may outlast its lease keeps its claim instead of letting a
// redelivery take the key and run the work a second time. Each renewal
// extends the lease to a full lease from that moment. If a renewal finds
// the claim lost (another delivery took the key), the body's context is
// cancelled, with a cause wrapping [store.ErrLost] (see [context.Cause]). A
// failed renewal for any other reason is logged and tried again at the
// next tick. Renewals run on a context detached from the request's
// cancellation and stop only when the body returns: a body that outlives
// its request (it ignored the cancellation) is still doing the work, and
// letting its lease lapse would let a redelivery run the work a second
// time beside it. A body stuck for good holds the key until its process
// ends; then the lease lapses and the key frees.
//
// interval must be at least [MinHeartbeat] (100 ms: each renewal is a
// write to the store) and shorter than the lease (a third of it leaves
// room for two failed renewals); [Lock] and [Mutex] return an error, and
// [Idempotent] panics, otherwise. Under [WithLeaseFromDeadline] the
// renewals tick at a third of the delivery's lease when that is shorter,
// which a lease of at least the settle timeout keeps above a third of
// MinSettleTimeout. The default is no heartbeat. On a backend without
// Extend, the option is ignored with a warning.
func WithHeartbeat(interval time.Duration) LockOption {
	return lockOption(func(c *lockConfig) { c.heartbeat = interval })
}

// WithLeaseFromDeadline sizes each claim's lease from the deadline of the
// context the claim is made on, instead of the fixed lease of [WithLease]:
// the time left until the deadline, plus the settle timeout (the Complete
// after a body that returned at the deadline may take that long; see
// [WithSettleTimeout]), plus margin. The functions framework puts such a
// deadline on every request when CLOUD_RUN_TIMEOUT_SECONDS is set, as the
// Cloud Run functions runtime sets it (to the function's timeout), so the
// key of a holder that crashed frees soon after the function's timeout
// instead of after the 15 minutes of [store.DefaultLease], during which
// every redelivery is a 503 that Pub/Sub counts against the
// subscription's max delivery attempts. On a context without a deadline,
// the lease is the one WithLease sets (by default store.DefaultLease).
//
// The lease is never shorter than the time the body may still
// legitimately run (its context is live until the deadline), and it is
// longer than WithLease's when the deadline is further away: WithLease is
// only the fallback. A deadline already past gives settle timeout +
// margin, which is at least [MinSettleTimeout], so at least [MinLease].
//
// margin covers what the deadline does not: a body that takes a moment to
// return once its context ends, and, on backends that judge leases by
// each instance's own clock, the skew between instances. It must not be
// negative: [Lock] and [Mutex] return an error, and [Idempotent] panics.
//
// A body that ignores its context and runs past the deadline outlives
// this lease. Pub/Sub redelivers the message (Cloud Run answers 504 at
// the timeout, and the push's ack deadline passes), the redelivery takes
// the lapsed key with a higher fence and runs the work a second time
// beside the late body, whose Complete is then fenced out (logged at
// ERROR, and acked). [WithHeartbeat] covers such a body: its renewals
// extend the lease by this delivery's lease for as long as the body runs,
// past the deadline too, at the configured interval or at a third of this
// delivery's lease when that is shorter; the key of a holder that crashed
// then frees one such lease after its last renewal. This option is not
// the default because of that body: with the fixed lease it has 15
// minutes beyond a short timeout before a redelivery can run it again.
func WithLeaseFromDeadline(margin time.Duration) LockOption {
	return lockOption(func(c *lockConfig) { c.fromDeadline, c.margin = true, margin })
}

// HashedKeyPrefix starts every key that [WithHashedKeys] hashes (after
// the [WithKeyPrefix] prefix): "sha256:" and 64 lowercase hex digits.
const HashedKeyPrefix = "sha256:"

// WithHashedKeys stores a key that the port refuses (longer than
// [store.MaxKeyLen] bytes once prefixed, or holding a NUL byte) as
// [HashedKeyPrefix] followed by the hex SHA-256 of the key, behind the
// [WithKeyPrefix] prefix, instead of refusing the event with a 400 that
// Pub/Sub redelivers until the dead-letter topic takes it. A key the port
// accepts is stored as it is, except one that itself starts with
// HashedKeyPrefix, which is hashed too: so no key that was stored plainly
// can ever meet the hash of another, and two different keys share a record
// only if SHA-256 collides.
//
// Hashing only the keys the port refuses, rather than all, keeps every key
// that was storable before spelled as before: turning the option on
// changes no record a pending redelivery could find (a plain key starting
// with "sha256:" is the one exception), and the stored keys stay readable.
// It applies to the keys of [MessageID], [Attribute], [JSONField] and any
// [KeyFunc] that returns the key itself; an error a KeyFunc of your own
// returns is not a key and still nacks.
func WithHashedKeys() Option {
	return option(func(c *config) { c.hashKeys = true })
}
