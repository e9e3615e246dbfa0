package fake

import (
	"context"
	"encoding/base64"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The operations ([store.Operator]) a fault can be injected into.
const (
	OpInspect Op = OpCompleteTx + 1 + iota
	OpList
	OpForceRelease
	OpForget
)

var _ store.Operator = (*Store)(nil)

// record returns the operator's view of r, read at now. It is called with
// s.mu held.
func (s *Store) record(key string, r *Record, now time.Time) store.Record {
	return store.Record{
		Key:         key,
		State:       r.State,
		Fence:       r.Fence,
		LeaseExpiry: r.LeaseExpiry,
		ExpiresAt:   r.ExpiresAt,
		Fingerprint: r.Fingerprint,
		Version:     store.VersionOf(r.Token),
		Now:         now,
	}
}

// Inspect implements [store.Inspector]: it reports key's record as stored,
// expired or not, with the Store's clock as Now, and changes nothing.
// Faults injected for [OpInspect] apply to it; a lost reply loses the
// record read.
func (s *Store) Inspect(ctx context.Context, key string) (store.Record, bool, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Record{}, false, err
	}
	cut := s.cuts.Load()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.begin(ctx, OpInspect, cut); err != nil {
		return store.Record{}, false, err
	}
	r, ok := s.recs[key]
	var rec store.Record
	if ok {
		rec = s.record(key, r, s.clock())
	}
	if err := s.reply(OpInspect, cut); err != nil {
		return store.Record{}, false, err
	}
	return rec, ok, nil
}

// cursorTag starts every cursor the Store issues.
const cursorTag = "fake1."

// cursor encodes the position after key in the listing of prefix and state.
func cursor(prefix string, state store.State, key string) string {
	raw := prefix + "\x00" + strconv.Itoa(int(state)) + "\x00" + key
	return cursorTag + base64.RawURLEncoding.EncodeToString([]byte(raw))
}

// after decodes q.Cursor: the key the listing continues after, "" to
// start. It refuses a cursor the Store did not issue for q's prefix and
// state.
func after(q store.ListQuery) (string, error) {
	if q.Cursor == "" {
		return "", nil
	}
	enc, ok := strings.CutPrefix(q.Cursor, cursorTag)
	raw, err := base64.RawURLEncoding.DecodeString(enc)
	if !ok || err != nil {
		return "", fmt.Errorf("%w: cursor %.40q was not issued by fake.Store", store.ErrInvalidQuery, q.Cursor)
	}
	parts := strings.SplitN(string(raw), "\x00", 3)
	if len(parts) != 3 || parts[0] != q.Prefix || parts[1] != strconv.Itoa(int(q.State)) ||
		!strings.HasPrefix(parts[2], q.Prefix) || store.ValidateKey(parts[2]) != nil {
		return "", fmt.Errorf("%w: the cursor belongs to another listing (prefix or state)", store.ErrInvalidQuery)
	}
	return parts[2], nil
}

// List implements [store.Lister]. It reports the records in key order
// (byte-wise), each once, expired ones as stored, and a page is short only
// at the end of the listing: Next is empty exactly when no selected
// record follows the page's last. It holds every record in memory, so a
// call reads the Store's whole map, once. The cursor is the last key of
// the page, encoded with the query's prefix and state: a cursor from
// another listing is refused with an error wrapping
// [store.ErrInvalidQuery]. Faults injected for [OpList] apply to it.
func (s *Store) List(ctx context.Context, q store.ListQuery) (store.Page, error) {
	if err := store.ValidateQuery(q); err != nil {
		return store.Page{}, err
	}
	from, err := after(q)
	if err != nil {
		return store.Page{}, err
	}
	limit := q.Limit
	if limit == 0 {
		limit = store.DefaultListLimit
	}
	cut := s.cuts.Load()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.begin(ctx, OpList, cut); err != nil {
		return store.Page{}, err
	}
	now := s.clock()
	var keys []string
	for k, r := range s.recs {
		if strings.HasPrefix(k, q.Prefix) && k > from && (q.State == 0 || r.State == q.State) {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	var page store.Page
	for i, k := range keys {
		if i == limit {
			page.Next = cursor(q.Prefix, q.State, keys[i-1])
			break
		}
		page.Records = append(page.Records, s.record(k, s.recs[k], now))
	}
	if err := s.reply(OpList, cut); err != nil {
		return store.Page{}, err
	}
	return page, nil
}

// current returns the record r describes if it is still that one (fence
// and version) and in state, or nil. It is called with s.mu held.
func (s *Store) current(r store.Record, state store.State) *Record {
	rec, ok := s.recs[r.Key]
	if !ok || rec.State != state || rec.Fence != r.Fence || store.VersionOf(rec.Token) != r.Version {
		return nil
	}
	return rec
}

// ForceRelease implements [store.ForceReleaser]: as Release does for the
// holder, it sets the lease expiry to now and increments the fence of the
// Claimed record r describes, live or lapsed. Faults injected for
// [OpForceRelease] apply to it, and [Store.LoseNextReply] and
// [Store.CutConnections] lose its reply after it took effect.
func (s *Store) ForceRelease(ctx context.Context, r store.Record) (bool, error) {
	if err := store.ValidateRecord(r); err != nil {
		return false, err
	}
	cut := s.cuts.Load()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.begin(ctx, OpForceRelease, cut); err != nil {
		return false, err
	}
	rec := s.current(r, store.Claimed)
	if rec != nil {
		rec.Fence++
		rec.LeaseExpiry = s.clock()
		rec.ExpiresAt = store.Instant(rec.LeaseExpiry, 0, s.TTL())
	}
	if err := s.reply(OpForceRelease, cut); err != nil {
		return false, err
	}
	return rec != nil, nil
}

// Forget implements [store.Forgetter]: it deletes the Done record r
// describes, expired or not. Faults injected for [OpForget] apply to it,
// and [Store.LoseNextReply] and [Store.CutConnections] lose its reply
// after it took effect.
func (s *Store) Forget(ctx context.Context, r store.Record) (bool, error) {
	if err := store.ValidateRecord(r); err != nil {
		return false, err
	}
	cut := s.cuts.Load()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.begin(ctx, OpForget, cut); err != nil {
		return false, err
	}
	rec := s.current(r, store.Done)
	if rec != nil {
		delete(s.recs, r.Key)
	}
	if err := s.reply(OpForget, cut); err != nil {
		return false, err
	}
	return rec != nil, nil
}
