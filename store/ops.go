package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Operations: optional interfaces for the people who run a service, to see
// the records a backend keeps and act on one safely. Every backend of this
// module set implements all four ([Operator]); the storetest suite checks
// them (RunOps).

// Record is an operator's view of one key's record: everything the record
// holds but the claim token, which only its holder may know (a token lets
// its bearer complete the claim).
type Record struct {
	// Key is the key the record belongs to.
	Key string
	// State is the stored state, Claimed or Done.
	State State
	// Fence is the record's fencing token.
	Fence int64
	// LeaseExpiry is, for a Claimed record, when its holder's lease lapses
	// (a released record's lease expiry is the release time). For a Done
	// record it is what the backend kept, possibly zero: do not rely on it.
	LeaseExpiry time.Time
	// ExpiresAt is, for a Done record, when duplicate suppression ends; for
	// a Claimed record, when the record may be deleted.
	ExpiresAt time.Time
	// Fingerprint is the payload fingerprint a Done record stores (see
	// [Fingerprinter]); empty when none.
	Fingerprint string
	// Version identifies the claim that last wrote the record:
	// VersionOf(token) of the token it stores. The token cannot be
	// recovered from it. ForceRelease and Forget act only on a record
	// whose fence and version are still those read.
	Version string
	// Now is the backend's clock when it read the record, the clock by
	// which Claim judges leases and ttls.
	Now time.Time
}

// Reclaimable reports whether a Claim made at r.Now would win the record:
// a Claimed record whose lease has lapsed, or a Done record past its
// expires-at instant.
func (r Record) Reclaimable() bool {
	switch r.State {
	case Claimed:
		return !r.Now.Before(r.LeaseExpiry)
	case Done:
		return !r.Now.Before(r.ExpiresAt)
	}
	return false
}

// VersionOf returns the version of a record whose claim token is token:
// the first 16 hex digits of its SHA-256 digest.
func VersionOf(token string) string {
	sum := sha256.Sum256([]byte(token))
	return hex.EncodeToString(sum[:8])
}

// ErrInvalidRecord reports a Record passed to ForceRelease or Forget that
// no read could have returned: an invalid key, a fence below 1, or an
// empty version.
var ErrInvalidRecord = errors.New("store: invalid record")

// ValidateRecord returns an error wrapping ErrInvalidRecord (and
// ErrInvalidKey for a bad key) when r could not have come from Inspect or
// List. ForceRelease and Forget call it before any I/O.
func ValidateRecord(r Record) error {
	if err := ValidateKey(r.Key); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidRecord, err)
	}
	switch {
	case r.Fence < 1:
		return fmt.Errorf("%w: fence %d is below 1", ErrInvalidRecord, r.Fence)
	case r.Version == "":
		return fmt.Errorf("%w: empty version", ErrInvalidRecord)
	}
	return nil
}

// Inspector is implemented by backends that can read one key's record
// without changing it.
type Inspector interface {
	// Inspect returns key's record as stored, with the backend's now, and
	// true; or a zero Record and false when there is no record. It
	// reports a record whose lease or ttl has passed as it is stored
	// (Reclaimable tells). It MUST validate key before any I/O, and MUST
	// NOT change any record.
	Inspect(ctx context.Context, key string) (Record, bool, error)
}

// Limits of a page of [Lister.List].
const (
	// DefaultListLimit is the page size when ListQuery.Limit is zero.
	DefaultListLimit = 100
	// MaxListLimit is the largest page size; a larger Limit is an error.
	MaxListLimit = 1000
)

// ListQuery selects the records one call of [Lister.List] returns.
type ListQuery struct {
	// Prefix selects the keys that start with it; empty selects every key.
	Prefix string
	// State selects records in that stored state; zero selects both.
	State State
	// Cursor continues a listing: empty starts it, and otherwise it is the
	// Page.Next a previous call with the same Prefix and State returned.
	Cursor string
	// Limit is the most records a page holds: zero means
	// DefaultListLimit; negative or above MaxListLimit is an error.
	Limit int
}

// ErrInvalidQuery reports a ListQuery that List refuses: a prefix longer
// than MaxKeyLen bytes or containing a NUL byte, an unknown state, a
// limit out of range, or a cursor that this backend did not issue for the
// same prefix and state.
var ErrInvalidQuery = errors.New("store: invalid list query")

// ValidateQuery returns an error wrapping ErrInvalidQuery for a prefix,
// state or limit that no backend accepts. It does not judge the cursor,
// which only the backend that issued it can read.
func ValidateQuery(q ListQuery) error {
	switch {
	case len(q.Prefix) > MaxKeyLen:
		return fmt.Errorf("%w: prefix of %d bytes, the limit is %d", ErrInvalidQuery, len(q.Prefix), MaxKeyLen)
	case strings.IndexByte(q.Prefix, 0) >= 0:
		return fmt.Errorf("%w: prefix contains a NUL byte", ErrInvalidQuery)
	case q.State != 0 && q.State != Claimed && q.State != Done:
		return fmt.Errorf("%w: unknown state %v", ErrInvalidQuery, q.State)
	case q.Limit < 0 || q.Limit > MaxListLimit:
		return fmt.Errorf("%w: limit %d is outside 0..%d", ErrInvalidQuery, q.Limit, MaxListLimit)
	}
	return nil
}

// Page is one page of a listing.
type Page struct {
	// Records are the records of this page, each as Inspect would report
	// it at the time of the read.
	Records []Record
	// Next continues the listing (ListQuery.Cursor); empty when the
	// listing is complete.
	Next string
	// Skipped counts the keys under the prefix that this call read and
	// skipped because they hold something other than a record: in a store
	// whose keyspace others share (Redis), another application's keys.
	// Zero for a backend whose records have a place of their own.
	Skipped int
}

// Lister is implemented by backends that can list their records by key
// prefix and state.
type Lister interface {
	// List returns one page of the records whose key starts with q.Prefix
	// and, when q.State is set, whose state is q.State.
	//
	// Rules, which the storetest suite checks (RunOps):
	//
	//   - It MUST validate q (ValidateQuery, and its own cursor) before any
	//     I/O, with errors wrapping ErrInvalidQuery, and MUST NOT change
	//     any record.
	//   - A page holds at most q.Limit records (DefaultListLimit when
	//     zero), and a call reads a bounded number of records, which the
	//     backend documents: a page MAY be short, even empty, while Next
	//     is set.
	//   - It MUST NOT report a record outside the prefix or, when q.State
	//     is set, in another state at the time of its read.
	//   - Following Next until it is empty, every record that exists
	//     under the prefix in the selected state for the whole listing
	//     MUST appear. A backend whose store reads keys in order reports
	//     each record once; one that cannot (Redis SCAN) MAY report a
	//     record twice, and documents it.
	List(ctx context.Context, q ListQuery) (Page, error)
}

// ForceReleaser is implemented by backends that can release a claim on
// behalf of an operator, for a holder that hung or died with a long lease.
type ForceReleaser interface {
	// ForceRelease releases the claim r describes, whoever holds it: if
	// the record is Claimed with fence r.Fence and version r.Version,
	// lease live or lapsed, it sets the lease expiry to now and increments
	// the fence, as the holder's own Release would. The next Claim wins
	// the key at once, and the old holder's Complete, Release and Extend
	// fail from then on, as for any replaced holder. One call of the old
	// holder may still be in flight: a Claim retried after a lost reply
	// matches its own token and may report Won with the raised fence and
	// a lease that has already lapsed, a holder that the next Claim
	// replaces like any lapsed one. Release the key when its holder is
	// gone, not while its Claim may still be retrying.
	//
	// It returns true when it released the record. It returns false, nil,
	// changing nothing, when the record is gone, Done, or no longer the
	// one r describes (another fence or version). It MUST validate r with
	// ValidateRecord before any I/O. After a lost reply it MAY return
	// false although it released; it MUST NOT return true when it did not.
	// It is safe to retry: the fence test lets at most one call release.
	ForceRelease(ctx context.Context, r Record) (bool, error)
}

// Forgetter is implemented by backends that can delete a Done record
// before its ttl ends, so that the next delivery of its key runs the work
// again (a replay after a fix).
type Forgetter interface {
	// Forget deletes the record r describes if it is Done with fence
	// r.Fence and version r.Version, whether or not its ttl has passed.
	// It returns true when it deleted the record. It returns false, nil,
	// changing nothing, when the record is gone, Claimed (live or lapsed:
	// Forget never deletes a claim; ForceRelease frees one), or no longer
	// the one r describes. It MUST validate r with ValidateRecord before
	// any I/O. After a lost reply it MAY return false although it
	// deleted; it MUST NOT return true when it did not.
	//
	// A holder from before the deletion stays fenced out: the next Claim
	// starts a new record at fence 1 with a new token, and Complete,
	// Release and Extend match the token too.
	Forget(ctx context.Context, r Record) (bool, error)
}

// Operator is a [Backend] with every operations interface: what the
// idempotency admin package and command-line tool need.
type Operator interface {
	Backend
	Inspector
	Lister
	ForceReleaser
	Forgetter
}
