package doclock

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The operations (store.Operator) on the records of a Store.
//
// Records are named by the key itself, or by "~" followed by the key in
// unpadded base64url when the backend's Name must encode it (a name that
// starts with "~" is always an encoded one). A listing scans the names in
// the service's order: the range of verbatim names that start with the
// prefix, then the range of encoded names whose base64url starts with the
// encoding of the prefix's whole 3-byte groups, each record filtered
// client-side by its key's prefix and its state (state is not indexed).

// OpStore is what a Store adds for the operations: a versioned delete and
// a scan of a range of names.
type OpStore interface {
	// Delete deletes key's record if its version is still base; applied
	// is false when it is not, or the record is gone. lost is as for
	// Store.Update: the delete may have applied even when err is set or
	// applied is false.
	Delete(ctx context.Context, key string, base int64) (applied bool, lost, err error)
	// Scan reads at most limit records whose names lie in rng, in the
	// service's order of names, with one query. done is true when the
	// range holds no record past those returned; rd is the reading that
	// judges them all.
	Scan(ctx context.Context, rng NameRange, limit int) (rows []Row, done bool, rd Reading, err error)
	// KeyOf is the inverse of the backend's Name: the key stored under
	// name, and false for a name that Name does not produce.
	KeyOf(name string) (string, bool)
	// EncodesAll reports whether Name encodes every key that starts with
	// prefix (Firestore's for a prefix that contains "/"), beyond the
	// keys that start with "~", which every backend encodes.
	EncodesAll(prefix string) bool
}

// NameRange is a range of record names: those after After when it is
// set, else from From on (every name when From is empty), and below To
// when it is set.
type NameRange struct {
	From, After, To string
}

// Row is a record a Scan read, with its name.
type Row struct {
	Name string
	Rec  Record
}

// ErrNoOps reports a Store without the OpStore methods.
var ErrNoOps = errors.New("the store does not implement the operations")

func (l *Lock) ops() (OpStore, error) {
	ops, ok := l.st.(OpStore)
	if !ok {
		return nil, ErrNoOps
	}
	return ops, nil
}

// toRecord is the operator's view of r, the record of key, read at now.
func toRecord(key string, r Record, rd Reading) store.Record {
	st := store.Claimed
	if r.State == StateDone {
		st = store.Done
	}
	return store.Record{
		Key: key, State: st, Fence: r.Fence, LeaseExpiry: r.Lease, ExpiresAt: r.Exp,
		Fingerprint: r.Fingerprint, Version: store.VersionOf(r.Token), Now: rd.At,
	}
}

// describes reports whether op, the record an operator read, still
// describes cur in state: the same fence and the same token's version.
func describes(cur Record, op store.Record, state int64) bool {
	return cur.State == state && cur.Fence == op.Fence && store.VersionOf(cur.Token) == op.Version
}

// Inspect implements store.Inspector: one read, the record judged by the
// read's time (its read_time, else the estimate of the server's time that
// Claim would judge by). It changes nothing.
func (l *Lock) Inspect(ctx context.Context, key string) (store.Record, bool, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Record{}, false, err
	}
	if err := ctx.Err(); err != nil {
		return store.Record{}, false, fmt.Errorf("%s: inspect %q: %w", l.name, key, err)
	}
	r, found, rd, err := l.st.Read(ctx, key)
	if err != nil {
		return store.Record{}, false, fmt.Errorf("%s: inspect %q: %w", l.name, key, err)
	}
	if !found {
		return store.Record{}, false, nil
	}
	return toRecord(key, r, rd), true, nil
}

// ForceRelease implements store.ForceReleaser: a read and, when the record
// is Claimed with op's fence and version, an update conditioned on the
// version the read saw that does what the holder's Release does: the
// lease ends at the read's time carried forward (an instant between the
// read and the server's now), the fence goes up by one, the token stays.
// When the record changed since the read (an Extend, say), it reads again
// and judges again.
//
// A write whose lease, carried forward by the client's clock, lands after
// the commit's server time (the client's clock jumped ahead) is written
// again with the lease ending at the commit's time.
//
// A write whose reply was lost is not recognised: the read after it finds
// the fence moved on and the call returns false, although it released.
// It returns true only for a write the service reported applied.
func (l *Lock) ForceRelease(ctx context.Context, op store.Record) (bool, error) {
	if err := store.ValidateRecord(op); err != nil {
		return false, err
	}
	fail := func(err error) (bool, error) {
		return false, fmt.Errorf("%s: force-release %q fence %d: %w", l.name, op.Key, op.Fence, err)
	}
	if err := ctx.Err(); err != nil {
		return fail(err)
	}
	for range maxRounds {
		cur, found, rd, err := l.st.Read(ctx, op.Key)
		if err != nil {
			return fail(err)
		}
		if !found || !describes(cur, op, StateClaimed) {
			return false, nil
		}
		now, ok := l.clock.after(rd)
		if !ok {
			return fail(ErrNoServerTime)
		}
		next := cur
		next.Fence++
		next.Lease, next.Exp = now, instant(now, l.ttl)
		v, applied, at, _, err := l.st.Update(ctx, op.Key, next, cur.Version)
		if err != nil {
			return fail(err)
		}
		if applied {
			if ranAhead(now, at) {
				// The read's time carried forward ran ahead of the commit
				// (the client's clock jumped ahead meanwhile): the lease
				// would end after the server's now and hold the key for
				// nobody. End it at the commit's time.
				fixed := next
				fixed.Lease, fixed.Exp = at, instant(at, l.ttl)
				_, ok, _, _, err := l.st.Update(ctx, op.Key, fixed, v)
				if err == nil && !ok {
					err = errors.New("the record changed since")
				}
				if err != nil {
					return fail(fmt.Errorf("released, but with a lease to %v, after the commit at %v, and ending it there failed: %w",
						next.Lease, at, err))
				}
			}
			return true, nil
		}
	}
	return fail(fmt.Errorf("still contended after %d rounds", maxRounds))
}

// Forget implements store.Forgetter: a read and, when the record is Done
// with op's fence and version, a delete conditioned on the version the
// read saw. A delete whose reply was lost is not recognised: the read
// after it finds the record gone and the call returns false, although it
// deleted. It returns true only for a delete the service reported applied.
func (l *Lock) Forget(ctx context.Context, op store.Record) (bool, error) {
	if err := store.ValidateRecord(op); err != nil {
		return false, err
	}
	fail := func(err error) (bool, error) {
		return false, fmt.Errorf("%s: forget %q fence %d: %w", l.name, op.Key, op.Fence, err)
	}
	ops, err := l.ops()
	if err != nil {
		return fail(err)
	}
	if err := ctx.Err(); err != nil {
		return fail(err)
	}
	for range maxRounds {
		cur, found, _, err := l.st.Read(ctx, op.Key)
		if err != nil {
			return fail(err)
		}
		if !found || !describes(cur, op, StateDone) {
			return false, nil
		}
		applied, _, err := ops.Delete(ctx, op.Key, cur.Version)
		if err != nil {
			return fail(err)
		}
		if applied {
			return true, nil
		}
	}
	return fail(fmt.Errorf("still contended after %d rounds", maxRounds))
}

// segment is a range of names that may hold the records of the keys under
// a prefix: from lo on, below hi (none when empty), ending at the first
// name that does not start with stop. verbatim segments skip encoded names
// (they are scanned in the encoded segment).
type segment struct {
	lo, hi, stop string
	verbatim     bool
}

// segments returns the name ranges to scan, in order, for the keys that
// start with prefix. encodesAll is true when the backend's Name encodes
// every key that starts with prefix.
func segments(prefix string, encodesAll bool) []segment {
	if prefix == "" {
		return []segment{{}} // every name, verbatim or encoded
	}
	enc := "~" + base64.RawURLEncoding.EncodeToString([]byte(prefix[:len(prefix)/3*3]))
	encoded := segment{lo: enc, hi: enc[:len(enc)-1] + string(enc[len(enc)-1]+1), stop: enc}
	if prefix[0] == '~' || encodesAll {
		return []segment{encoded} // Name encodes every key that starts with prefix
	}
	// The verbatim names under prefix are valid UTF-8: they start with the
	// prefix's longest valid head, and when the rest is more than an
	// incomplete last character, there are none.
	head := validHead(prefix)
	if tail := prefix[len(head):]; tail != "" && utf8.FullRuneInString(tail) {
		return []segment{encoded}
	}
	return []segment{{lo: head, hi: successor(head), stop: head, verbatim: true}, encoded}
}

// validHead returns the longest prefix of s that is valid UTF-8.
func validHead(s string) string {
	for i, r := range s {
		if r == utf8.RuneError {
			if _, n := utf8.DecodeRuneInString(s[i:]); n == 1 {
				return s[:i]
			}
		}
	}
	return s
}

// successor returns the least string above every string that starts with
// s, valid UTF-8 whatever order the service compares names in (UTF-8
// bytes, code points, or UTF-16 code units, as some emulators do), or ""
// (no bound) when those orders disagree on it: s's last character is
// raised by one when it lies below U+D7FF, where all three orders agree.
func successor(s string) string {
	r, n := utf8.DecodeLastRuneInString(s)
	if n == 0 || r == utf8.RuneError || r >= 0xD7FF {
		return ""
	}
	return s[:len(s)-n] + string(r+1)
}

// cursorTag starts every cursor List issues.
const cursorTag = "c1."

// queryID ties a cursor to the backend and the query it continues.
func (l *Lock) queryID(q store.ListQuery) []byte {
	sum := sha256.Sum256(fmt.Appendf(nil, "%s\x00%d\x00%s", l.name, q.State, q.Prefix))
	return sum[:8]
}

// cursor encodes the position after name in segment seg.
func (l *Lock) cursor(q store.ListQuery, seg int, after string) string {
	b := append(l.queryID(q), byte(seg))
	return cursorTag + base64.RawURLEncoding.EncodeToString(append(b, after...))
}

// position decodes q.Cursor, which must come from a List of this backend
// with q's prefix and state, for a listing of n segments.
func (l *Lock) position(q store.ListQuery, n int) (seg int, after string, err error) {
	raw, err := base64.RawURLEncoding.DecodeString(strings.TrimPrefix(q.Cursor, cursorTag))
	id := l.queryID(q)
	if err != nil || !strings.HasPrefix(q.Cursor, cursorTag) || len(raw) <= len(id) || string(raw[:len(id)]) != string(id) ||
		int(raw[len(id)]) >= n || !utf8.Valid(raw[len(id)+1:]) {
		return 0, "", fmt.Errorf("%w: the cursor was not issued by %s for prefix %q and state %v", store.ErrInvalidQuery, l.name, q.Prefix, q.State)
	}
	return int(raw[len(id)]), string(raw[len(id)+1:]), nil
}

// List implements store.Lister. It scans names in the service's order
// (see segments) with queries on the entity key or document name alone,
// which need no composite index, and filters the state client-side: a call
// reads at most the page's limit of records, so a page may be short (even
// empty) while Next is set when the listing skips records of another
// state or another prefix. The cursor is the last name read, encoded with
// a digest of the prefix and state.
func (l *Lock) List(ctx context.Context, q store.ListQuery) (store.Page, error) {
	if err := store.ValidateQuery(q); err != nil {
		return store.Page{}, err
	}
	fail := func(err error) (store.Page, error) {
		return store.Page{}, fmt.Errorf("%s: list %q: %w", l.name, q.Prefix, err)
	}
	ops, err := l.ops()
	if err != nil {
		return fail(err)
	}
	segs := segments(q.Prefix, ops.EncodesAll(q.Prefix))
	seg, after := 0, ""
	if q.Cursor != "" {
		if seg, after, err = l.position(q, len(segs)); err != nil {
			return store.Page{}, err
		}
	}
	if err := ctx.Err(); err != nil {
		return fail(err)
	}
	limit := q.Limit
	if limit == 0 {
		limit = store.DefaultListLimit
	}
	var page store.Page
	for budget := limit; budget > 0 && seg < len(segs); {
		s := segs[seg]
		rows, done, rd, err := ops.Scan(ctx, NameRange{From: s.lo, After: after, To: s.hi}, budget)
		if err != nil {
			return fail(err)
		}
		budget -= len(rows)
		for _, row := range rows {
			if !strings.HasPrefix(row.Name, s.stop) {
				done = true // past the segment's names
				break
			}
			after = row.Name
			if s.verbatim && strings.HasPrefix(row.Name, "~") {
				continue
			}
			key, ok := ops.KeyOf(row.Name)
			if !ok || !strings.HasPrefix(key, q.Prefix) {
				continue
			}
			if rec := toRecord(key, row.Rec, rd); q.State == 0 || rec.State == q.State {
				page.Records = append(page.Records, rec)
			}
		}
		if done {
			seg, after = seg+1, ""
			continue
		}
		if len(rows) == 0 {
			break // a reply with no record and more to come: continue on the next call
		}
	}
	if seg < len(segs) {
		page.Next = l.cursor(q, seg, after)
	}
	return page, nil
}
