// Package store defines the port between the idempotency verbs and a storage
// backend: three methods over one record per key, with leases, fencing tokens
// and a retention ttl.
//
// # The record
//
// A backend keeps at most one record per key. The record is in one of two
// stored states, [Claimed] or [Done], and carries:
//
//   - a fence: an int64 that starts at 1 when the record is created and only
//     ever rises while the record exists;
//   - a lease expiry: until then a Claimed record belongs to its holder;
//   - an expires-at instant: for a Done record, when duplicate suppression
//     ends (completion time + ttl); for a Claimed record, lease expiry + ttl,
//     so the record outlives every holder that could still be running;
//   - the token of the Claim call that last won it.
//
// "Reclaimable" is not a stored state: it is what Claim concludes when it
// reads a Claimed record whose lease has lapsed, or a Done record past its
// expires-at instant. Nothing sweeps records in the background; a backend may
// physically delete a record only after its expires-at instant.
//
// # Transitions
//
//	from     call      guard                         to        result        fence
//	absent   Claim     -                             Claimed   Won           1
//	Claimed  Claim     now < lease expiry            Claimed   HeldByOther   same
//	Claimed  Claim     now >= lease expiry           Claimed   Won           +1
//	Claimed  Complete  fence matches (no lease test) Done      true          same
//	Claimed  Complete  fence differs                 Claimed   false         same
//	Claimed  Release   fence matches                 Claimed*  -             +1
//	Done     Claim     now < expires at              Done      AlreadyDone   same
//	Done     Claim     now >= expires at             Claimed   Won           +1
//	Done     Complete  fence matches                 Done      true          same
//	Done     Release   any                           Done      -             same
//
// Claimed* is a Claimed record whose lease expiry was set to the release
// time: the next Claim wins it at once.
//
// The fence is the ownership test of Complete and Release; the lease is not.
// A holder whose lease lapsed but whom nobody replaced still completes: it is
// the only party that ran the work. A holder that was replaced (or that
// released) holds a stale fence and can change nothing. Complete, Release
// and Extend also match the claim's token: once a record is deleted after
// its expires-at, the next Claim starts a fresh record at fence 1, the fence
// a holder from before the deletion may carry, and only the token tells the
// two claims apart.
//
// # Growing the port
//
// Like database/sql/driver, the port grows by optional interfaces that a
// backend may implement beside [Backend]: [Extender], [Purger],
// [Fingerprinter], [TxCompleter], and the operations interfaces
// [Inspector], [Lister], [ForceReleaser] and [Forgetter] ([Operator]).
// Callers discover them with a type assertion.
package store

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// Default durations, shared by every backend and verb.
const (
	// DefaultLease is the lease a claim gets when the caller does not choose
	// one. It must exceed the longest run of the guarded work.
	DefaultLease = 15 * time.Minute

	// DefaultTTL is how long a completed key suppresses duplicates, and how
	// long a Claimed record outlives its lease. Lease + ttl must exceed the
	// longest life of a holder process (Cloud Run caps a request at 60 min;
	// 15 min + 1 h clears it). Every backend takes any positive ttl in its
	// place, up to math.MaxInt64 (see [ValidateTTL]).
	DefaultTTL = time.Hour
)

// MaxKeyLen is the longest key, in bytes, that every backend accepts.
const MaxKeyLen = 1024

// Sentinel errors of the port. Backends wrap them; callers test them with
// errors.Is.
var (
	// ErrInvalidKey reports a key that no backend stores: empty, longer than
	// MaxKeyLen bytes, or containing a NUL byte.
	ErrInvalidKey = errors.New("store: invalid key")

	// ErrInvalidLease reports a lease that is zero or negative.
	ErrInvalidLease = errors.New("store: invalid lease")

	// ErrInvalidTTL reports a ttl that is zero or negative.
	ErrInvalidTTL = errors.New("store: invalid ttl")

	// ErrInvalidFingerprint reports a fingerprint longer than
	// MaxFingerprintLen bytes, not valid UTF-8, or containing a NUL byte.
	ErrInvalidFingerprint = errors.New("store: invalid fingerprint")

	// ErrLost reports, from an optional method such as Extend, that the
	// caller's claim is no longer the current one (its fence is stale or its
	// record is gone).
	ErrLost = errors.New("store: claim lost")
)

// ValidateKey returns an error wrapping ErrInvalidKey when key is empty,
// longer than MaxKeyLen bytes, or contains a NUL byte. Backends call it
// before any I/O.
func ValidateKey(key string) error {
	switch {
	case key == "":
		return fmt.Errorf("%w: empty", ErrInvalidKey)
	case len(key) > MaxKeyLen:
		return fmt.Errorf("%w: %d bytes, the limit is %d", ErrInvalidKey, len(key), MaxKeyLen)
	case strings.IndexByte(key, 0) >= 0:
		return fmt.Errorf("%w: contains a NUL byte", ErrInvalidKey)
	}
	return nil
}

// MaxFingerprintLen is the longest payload fingerprint, in bytes, that
// every [Fingerprinter] stores.
const MaxFingerprintLen = 128

// ValidateFingerprint returns an error wrapping ErrInvalidFingerprint when
// fp is longer than MaxFingerprintLen bytes, is not valid UTF-8 (the
// Datastore, Firestore and Spanner string types require it), or contains a
// NUL byte. The empty fingerprint is valid: it means none.
func ValidateFingerprint(fp string) error {
	switch {
	case len(fp) > MaxFingerprintLen:
		return fmt.Errorf("%w: %d bytes, the limit is %d", ErrInvalidFingerprint, len(fp), MaxFingerprintLen)
	case !utf8.ValidString(fp):
		return fmt.Errorf("%w: not valid UTF-8", ErrInvalidFingerprint)
	case strings.IndexByte(fp, 0) >= 0:
		return fmt.Errorf("%w: contains a NUL byte", ErrInvalidFingerprint)
	}
	return nil
}

// ValidateLease returns an error wrapping ErrInvalidLease when lease is not
// positive. Every positive lease is valid, up to math.MaxInt64 (about 292
// years), and a backend honours it: it computes the lease expiry with
// [Instant] or sends the lease in its store's unit with [CeilUnits], which
// round up and saturate (at [MaxInstant]) rather than wrap, so a lease at
// the limit of time.Duration never ends in the past.
func ValidateLease(lease time.Duration) error {
	if lease <= 0 {
		return fmt.Errorf("%w: %v is not positive", ErrInvalidLease, lease)
	}
	return nil
}

// ValidateTTL returns an error wrapping ErrInvalidTTL when ttl is not
// positive. Backends call it from their constructors. Every positive ttl
// is valid, up to math.MaxInt64, and a backend honours it as it honours a
// lease (see [ValidateLease]): the port saturates, it does not refuse.
func ValidateTTL(ttl time.Duration) error {
	if ttl <= 0 {
		return fmt.Errorf("%w: %v is not positive", ErrInvalidTTL, ttl)
	}
	return nil
}

// NewToken returns a random claim token: 24 hex digits from crypto/rand,
// distinct per call with overwhelming probability. Backends write it into
// the record a Claim wins, so that a retry of that Claim can tell its own
// win from someone else's.
func NewToken() string {
	var buf [12]byte
	rand.Read(buf[:])
	return hex.EncodeToString(buf[:])
}

// State is the stored state of a record.
type State int

// The two stored states.
const (
	// Claimed: a holder owns the key until its lease expires.
	Claimed State = iota + 1
	// Done: the work completed; Claim reports AlreadyDone until the ttl ends.
	Done
)

// String returns "claimed", "done", or "state(N)".
func (s State) String() string {
	switch s {
	case Claimed:
		return "claimed"
	case Done:
		return "done"
	}
	return fmt.Sprintf("state(%d)", int(s))
}

// Outcome is what a Claim call concluded. Every outcome is a normal result,
// never an error.
type Outcome int

// The three outcomes of Claim.
const (
	// Won: the caller now holds the key; Result.Claim is set.
	Won Outcome = iota + 1
	// AlreadyDone: the key completed within its ttl.
	AlreadyDone
	// HeldByOther: another holder's lease is live.
	HeldByOther
)

// String returns "won", "already done", "held by other", or "outcome(N)".
func (o Outcome) String() string {
	switch o {
	case Won:
		return "won"
	case AlreadyDone:
		return "already done"
	case HeldByOther:
		return "held by other"
	}
	return fmt.Sprintf("outcome(%d)", int(o))
}

// Claim identifies one won claim on a key. A caller passes it back unchanged
// to Complete, Release or Extend.
type Claim struct {
	// Key is the key as the caller gave it to Claim.
	Key string
	// Fence is the fencing token: it rises on every reclaim and release, so a
	// holder that was replaced can be told apart from the current one. A sink
	// that receives writes from holders can reject a write whose fence is
	// lower than one it has already seen.
	Fence int64
	// Token is unique per Claim call. A backend writes it into the record so
	// that a Claim retried after a lost response recognises its own claim.
	Token string
	// LeaseExpiry is when the lease lapses, by the backend's clock.
	LeaseExpiry time.Time
	// Rev is backend-private revision data (for example a Datastore entity
	// version) that lets Complete and Release skip a read. Zero means
	// unknown. Callers must not change it. It names the record as this
	// claim wrote it, Token included: a backend may act on a matching Rev
	// without comparing the Token.
	Rev int64
}

// Result is what Claim returns.
type Result struct {
	// Outcome says which of the three cases happened.
	Outcome Outcome
	// Claim is set when Outcome is Won.
	Claim Claim
	// Until is, for HeldByOther, when the holder's lease lapses; for
	// AlreadyDone, when duplicate suppression ends. Zero when the backend
	// does not know.
	Until time.Time
	// Fingerprint is, for AlreadyDone, the payload fingerprint that the
	// completing call stored (see [Fingerprinter]); empty when it stored
	// none, or the backend does not keep fingerprints. Empty for the other
	// outcomes.
	Fingerprint string
}

// Backend is the port every storage backend implements.
//
// Rules for every method, which the storetest suite checks:
//
//   - It MUST be safe for concurrent use by multiple goroutines, and by
//     multiple processes sharing the same storage.
//   - It MUST honour ctx: return promptly once ctx is done, with an error
//     that wraps ctx.Err() when the call did not finish.
//   - It MUST validate its arguments before any I/O and return errors that
//     wrap ErrInvalidKey or ErrInvalidLease for bad ones.
//   - It MUST wrap a driver's error with %w so callers can inspect it.
//   - It MUST NOT report a claim as not won when it may have won it: if the
//     outcome of a write is unknown, return an error, not HeldByOther.
//   - It MUST NOT delete a record before its expires-at instant.
//   - It MUST honour every positive lease and ttl, up to math.MaxInt64:
//     instants through [Instant], durations in a store's unit through
//     [CeilUnits], never arithmetic that can wrap into the past.
//   - Complete, Release and Extend MUST act only on a record whose fence
//     and token both match the claim's.
type Backend interface {
	// Claim atomically creates the record for key (fence 1), or reclaims it
	// when the lease has lapsed or the Done ttl has elapsed (fence + 1), and
	// otherwise reports who has it. Expiry is judged when the record is read.
	// The new lease runs for lease from the backend's now.
	//
	// Claim MAY retry internally (for example after a transaction conflict
	// or a lost commit response); a retry MUST reuse the same claim token so
	// that finding its own claim yields Won with the same fence, not
	// HeldByOther and not a second fence increment.
	Claim(ctx context.Context, key string, lease time.Duration) (Result, error)

	// Complete moves the record from Claimed to Done if its fence equals
	// c.Fence, whether or not the lease has lapsed, and reports whether the
	// record is Done with that fence afterwards. It returns false, nil when
	// the fence is stale or the record is gone. Completing an already Done
	// record with the same fence returns true and changes nothing. It is
	// safe to retry.
	Complete(ctx context.Context, c Claim) (bool, error)

	// Release gives up a claim without completing it: if the record is
	// Claimed with fence c.Fence, it sets the lease expiry to now and
	// increments the fence, so the key is reclaimable at once and c can never
	// complete. It never deletes the record (a fresh record would restart the
	// fence at 1 and let an old claim match again). With a stale fence, a
	// Done record or no record it does nothing and returns nil. It is safe
	// to retry.
	Release(ctx context.Context, c Claim) error
}

// Extender is implemented by backends that can renew a live lease, so long
// work can keep its claim (a heartbeat).
type Extender interface {
	// Extend sets the lease of the Claimed record with fence c.Fence to run
	// for lease from the backend's now, and returns the updated claim (same
	// fence). It returns an error wrapping ErrLost when the record is not
	// Claimed with that fence. It never changes the fence.
	Extend(ctx context.Context, c Claim, lease time.Duration) (Claim, error)
}

// Purger is implemented by backends whose storage does not delete expired
// records by itself (for example SQL tables, or Datastore without a TTL
// policy).
type Purger interface {
	// PurgeExpired deletes at most limit records whose expires-at instant
	// has passed, and returns how many it deleted. It never deletes a record
	// that Claim could still find live. A limit of zero or less means no
	// limit.
	PurgeExpired(ctx context.Context, limit int) (int, error)
}

// Fingerprinter is implemented by backends that keep, in a Done record, a
// fingerprint of the payload whose work completed it, so that a later
// delivery of the same key with a different payload can be told apart from
// a true duplicate.
type Fingerprinter interface {
	// CompleteFingerprint is Complete that also stores fp in the record it
	// moves to Done; a Claim that finds the record Done reports fp in
	// Result.Fingerprint until the record is reclaimed. It MUST validate fp
	// with ValidateFingerprint before any I/O. An empty fp stores none,
	// exactly as Complete does; Complete and CompleteFingerprint clear a
	// fingerprint left from an earlier life of the record (a reclaim after
	// the ttl starts without one). Completing an already Done record with
	// the same fence returns true and changes nothing, the stored
	// fingerprint included. It is safe to retry.
	CompleteFingerprint(ctx context.Context, c Claim, fp string) (bool, error)
}
