// Package admin is the library behind an operator's view of a backend: read
// one key's record, list and count records by key prefix, release a stuck
// claim, forget a completed key (or every completed key under a prefix in a
// window of completion time) so that its next delivery runs again, and
// purge expired records. The idemctl command-line tool
// (cmd/idemctl) is built on it; a team can put the same calls behind its
// own admin page.
//
// Every function works on the optional operations interfaces of the store
// package ([store.Operator]: Inspect, List, ForceRelease, Forget), which
// every backend of this module set implements. The destructive calls act
// only on the record as they read it: [Release] and [Forget] pass the
// record Inspect returned to ForceRelease or Forget, which change nothing
// when the record's fence or version moved since (a holder claimed,
// completed or released in between), and report that with [ErrChanged].
// None of them ever deletes a claim: only Done records are forgotten.
package admin

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Errors of the package. Functions wrap them; test them with errors.Is.
var (
	// ErrNotFound reports that the key has no record.
	ErrNotFound = errors.New("admin: no record for the key")
	// ErrNotClaimed reports a Release of a key whose record is not
	// Claimed (it is Done): there is no claim to release.
	ErrNotClaimed = errors.New("admin: the record is not claimed")
	// ErrNotDone reports a Forget of a key whose record is not Done (it
	// is Claimed): a claim is never forgotten; Release frees it.
	ErrNotDone = errors.New("admin: the record is not done")
	// ErrChanged reports that the record changed between the read and the
	// write that was to act on it (another fence or version, or gone), so
	// nothing was changed. Read it again and decide again.
	ErrChanged = errors.New("admin: the record changed since it was read")
	// ErrNoPrefix reports a [Filter] that selects every key without
	// saying so: an empty Prefix needs All.
	ErrNoPrefix = errors.New("admin: no prefix (set Filter.All to select every key)")
	// ErrInvalidFilter reports a [Filter] whose fields contradict each
	// other or are out of range.
	ErrInvalidFilter = errors.New("admin: invalid filter")
	// ErrNoProgress reports a backend whose listing does not advance: an
	// empty page whose Next is the cursor it was asked for.
	ErrNoProgress = errors.New("admin: the backend's listing does not advance")
	// ErrNotSupported reports a backend that lacks the optional interface
	// an operation needs (Purge on a backend that is not a
	// [store.Purger]: Redis expires its records itself).
	ErrNotSupported = errors.New("admin: the backend does not support this operation")
)

// Get returns key's record as the backend stores it, or an error wrapping
// [ErrNotFound] when there is none. It changes nothing. An invalid key is
// an error wrapping [store.ErrInvalidKey].
func Get(ctx context.Context, b store.Inspector, key string) (store.Record, error) {
	r, ok, err := b.Inspect(ctx, key)
	if err != nil {
		return store.Record{}, fmt.Errorf("admin: inspecting %q: %w", key, err)
	}
	if !ok {
		return store.Record{}, fmt.Errorf("%w: %q", ErrNotFound, key)
	}
	return r, nil
}

// List returns an iterator over the records q selects, following each
// page's cursor until the listing ends: q.Prefix and q.State select, q.Limit
// is the size of each page (zero: [store.DefaultListLimit]), and a set
// q.Cursor resumes a listing where that cursor left it. The iterator
// changes nothing. On an error (an invalid query wraps
// [store.ErrInvalidQuery]) it yields a zero Record with the error, once,
// and stops; a backend that answers an empty page with the very cursor it
// was given would never end the listing, and is such an error, wrapping
// [ErrNoProgress]. A backend that cannot read keys in order (Redis SCAN) may
// yield a record twice; see [store.Lister].
func List(ctx context.Context, b store.Lister, q store.ListQuery) iter.Seq2[store.Record, error] {
	return func(yield func(store.Record, error) bool) {
		for {
			p, err := b.List(ctx, q)
			if err != nil {
				yield(store.Record{}, fmt.Errorf("admin: listing %q: %w", q.Prefix, err))
				return
			}
			for _, r := range p.Records {
				if !yield(r, nil) {
					return
				}
			}
			if p.Next == "" {
				return
			}
			if len(p.Records) == 0 && p.Next == q.Cursor {
				yield(store.Record{}, fmt.Errorf("%w: listing %q: an empty page whose cursor is the one it was given", ErrNoProgress, q.Prefix))
				return
			}
			q.Cursor = p.Next
		}
	}
}

// Counts is how many records a prefix holds, by stored state and by
// whether a Claim would win them now ([store.Record.Reclaimable], by the
// backend's clock at each read).
type Counts struct {
	// ClaimedLive counts Claimed records whose lease is live: a holder
	// is (or should be) running the work.
	ClaimedLive int
	// ClaimedLapsed counts Claimed records whose lease has lapsed (a
	// holder died or released): the next delivery runs the work.
	ClaimedLapsed int
	// DoneLive counts Done records within their ttl: their duplicates
	// are suppressed.
	DoneLive int
	// DoneExpired counts Done records past their ttl, not yet deleted:
	// the next delivery runs the work again.
	DoneExpired int
}

// Total returns the number of records counted.
func (c Counts) Total() int { return c.ClaimedLive + c.ClaimedLapsed + c.DoneLive + c.DoneExpired }

// Count counts the records whose key starts with prefix (every record for
// an empty prefix), listing them in pages of [store.MaxListLimit]. It
// changes nothing. Each record is counted once even on a backend whose
// listing may repeat one (Redis): Count keeps the keys it counted in
// memory, about their length plus 50 bytes each.
func Count(ctx context.Context, b store.Lister, prefix string) (Counts, error) {
	var c Counts
	seen := make(map[string]struct{})
	for r, err := range List(ctx, b, store.ListQuery{Prefix: prefix, Limit: store.MaxListLimit}) {
		if err != nil {
			return Counts{}, err
		}
		if _, dup := seen[r.Key]; dup {
			continue
		}
		seen[r.Key] = struct{}{}
		switch {
		case r.State == store.Claimed && !r.Reclaimable():
			c.ClaimedLive++
		case r.State == store.Claimed:
			c.ClaimedLapsed++
		case r.State == store.Done && !r.Reclaimable():
			c.DoneLive++
		case r.State == store.Done:
			c.DoneExpired++
		}
	}
	return c, nil
}

// Change is what [Release] or [Forget] did to one key.
type Change struct {
	// Before is the record as read before the change, the one acted on.
	Before store.Record
	// After is the record as read after the change; nil when there is
	// none (a forgotten key). It is a new read: a Claim that came in
	// between shows there.
	After *store.Record
}

// Release frees key's claim on behalf of an operator, for a holder that
// hung or died with a long lease: it reads the record and force-releases
// exactly that record ([store.ForceReleaser]), live or lapsed lease alike,
// so that the next delivery wins the key at once with a higher fence and
// the old holder's Complete, Release and Extend fail. It returns the
// record before and after.
//
// It refuses, changing nothing, with an error wrapping [ErrNotFound] when
// key has no record, [ErrNotClaimed] when the record is Done (use
// [Forget]), and [ErrChanged] when the record changed between the read
// and the release (the Change then holds the record read, in Before).
func Release(ctx context.Context, b store.Operator, key string) (Change, error) {
	before, err := Get(ctx, b, key)
	if err != nil {
		return Change{}, err
	}
	ch := Change{Before: before}
	if before.State != store.Claimed {
		return ch, fmt.Errorf("%w: %q is %v; forget a done key instead", ErrNotClaimed, key, before.State)
	}
	ok, err := b.ForceRelease(ctx, before)
	if err != nil {
		return ch, fmt.Errorf("admin: releasing %q: %w", key, err)
	}
	if !ok {
		return ch, fmt.Errorf("%w: %q was released, completed or reclaimed by someone else; nothing changed", ErrChanged, key)
	}
	return after(ctx, b, ch)
}

// Forget deletes key's Done record before its ttl ends, so that the next
// delivery of the key runs the work again (a replay after a fix): it reads
// the record and forgets exactly that record ([store.Forgetter]). It
// returns the record before (After is nil unless a Claim recreated the
// key at once).
//
// It refuses, changing nothing, with an error wrapping [ErrNotFound] when
// key has no record, [ErrNotDone] when the record is Claimed (a claim is
// never forgotten: a free one, released or lapsed, needs nothing, since
// its next delivery runs the work; a held one can be freed with
// [Release]), and [ErrChanged] when the record changed between the read
// and the delete.
func Forget(ctx context.Context, b store.Operator, key string) (Change, error) {
	before, err := Get(ctx, b, key)
	if err != nil {
		return Change{}, err
	}
	ch := Change{Before: before}
	switch {
	case before.State == store.Claimed && before.Reclaimable():
		// Not "release it": a released claim is one of these, and the
		// advice would loop.
		return ch, fmt.Errorf("%w: %q is claimed but free (released, or its lease lapsed): its next delivery runs the work already; nothing to forget", ErrNotDone, key)
	case before.State == store.Claimed:
		return ch, fmt.Errorf("%w: %q is claimed with a live lease: a delivery is running the work, which runs again only if it fails; if its holder is gone, release the key instead", ErrNotDone, key)
	case before.State != store.Done:
		return ch, fmt.Errorf("%w: %q is %v", ErrNotDone, key, before.State)
	}
	ok, err := b.Forget(ctx, before)
	if err != nil {
		return ch, fmt.Errorf("admin: forgetting %q: %w", key, err)
	}
	if !ok {
		return ch, fmt.Errorf("%w: %q was reclaimed or changed by someone else; nothing changed", ErrChanged, key)
	}
	return after(ctx, b, ch)
}

// after reads ch.Before's key again into ch.After.
func after(ctx context.Context, b store.Inspector, ch Change) (Change, error) {
	r, ok, err := b.Inspect(ctx, ch.Before.Key)
	if err != nil {
		return ch, fmt.Errorf("admin: reading %q after the change (the change was made): %w", ch.Before.Key, err)
	}
	if ok {
		ch.After = &r
	}
	return ch, nil
}

// Filter selects the Done records [ForgetDone] forgets.
//
// A record does not store when it was completed, only its expires-at
// instant, completion time + the ttl of the service that completed it. The
// window is on completion time, computed as ExpiresAt - TTL: set TTL to
// the ttl your service's backend is configured with (its WithTTL; zero
// means [store.DefaultTTL]). A wrong TTL shifts the window by the
// difference. Backends store expires-at rounded to their unit (Redis and
// SQL: a millisecond; Datastore, Firestore, Spanner: a microsecond), so a
// completion within that unit of a bound may fall on either side of it.
// A record whose expires-at is [store.MaxInstant] (done for good, as
// redislock reports a key someone made persistent) has no completion
// time: a window (DoneFrom or DoneBefore) never selects it.
type Filter struct {
	// Prefix selects the keys that start with it. It is required: an
	// empty Prefix is refused unless All is set.
	Prefix string
	// All selects every key; Prefix must then be empty. It exists so that
	// forgetting every completed key is never an accident.
	All bool
	// DoneFrom, when set, selects records completed at or after it.
	DoneFrom time.Time
	// DoneBefore, when set, selects records completed before it.
	DoneBefore time.Time
	// TTL is the ttl the service completes keys with, by which the
	// completion time is computed; zero means [store.DefaultTTL].
	TTL time.Duration
}

// ttl returns f.TTL or its default.
func (f Filter) ttl() time.Duration {
	if f.TTL == 0 {
		return store.DefaultTTL
	}
	return f.TTL
}

// validate returns an error wrapping ErrNoPrefix or ErrInvalidFilter.
func (f Filter) validate() error {
	switch {
	case f.Prefix == "" && !f.All:
		return ErrNoPrefix
	case f.Prefix != "" && f.All:
		return fmt.Errorf("%w: All with a prefix %q (choose one)", ErrInvalidFilter, f.Prefix)
	case f.TTL < 0:
		return fmt.Errorf("%w: ttl %v is negative", ErrInvalidFilter, f.TTL)
	case !f.DoneFrom.IsZero() && !f.DoneBefore.IsZero() && !f.DoneFrom.Before(f.DoneBefore):
		return fmt.Errorf("%w: DoneFrom %v is not before DoneBefore %v", ErrInvalidFilter, f.DoneFrom, f.DoneBefore)
	}
	if err := store.ValidateQuery(store.ListQuery{Prefix: f.Prefix}); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidFilter, err)
	}
	return nil
}

// DoneAt returns when r was completed, for a Done record whose service
// completes keys with ttl (zero means [store.DefaultTTL]): r.ExpiresAt -
// ttl. It is meaningless for a Claimed record.
func DoneAt(r store.Record, ttl time.Duration) time.Time {
	if ttl == 0 {
		ttl = store.DefaultTTL
	}
	return r.ExpiresAt.Add(-ttl)
}

// match reports whether the Done record r falls in f's window.
func (f Filter) match(r store.Record) bool {
	if r.State != store.Done {
		return false
	}
	windowed := !f.DoneFrom.IsZero() || !f.DoneBefore.IsZero()
	if windowed && !r.ExpiresAt.Before(store.MaxInstant) {
		return false // no completion time: done for good
	}
	at := DoneAt(r, f.ttl())
	if !f.DoneFrom.IsZero() && at.Before(f.DoneFrom) {
		return false
	}
	if !f.DoneBefore.IsZero() && !at.Before(f.DoneBefore) {
		return false
	}
	return true
}

// Report is what [ForgetDone] planned and did.
type Report struct {
	// Plan is every Done record the filter selected, as read, in the
	// order listed: what a run forgets unless a record changes first.
	Plan []store.Record
	// DryRun reports that nothing was forgotten: Plan is all there is.
	DryRun bool
	// Forgotten is the records of Plan that were forgotten.
	Forgotten []store.Record
	// Skipped is the records of Plan that were not, because they changed
	// after the plan read them (reclaimed, forgotten by someone else, or
	// gone).
	Skipped []store.Record
}

// Plan returns the Done records f selects, as read, each once, in the
// order the backend lists them. It changes nothing. It holds them all in
// memory: narrow the prefix or the window for a large store.
func Plan(ctx context.Context, b store.Lister, f Filter) ([]store.Record, error) {
	if err := f.validate(); err != nil {
		return nil, err
	}
	var plan []store.Record
	seen := make(map[string]struct{})
	for r, err := range List(ctx, b, store.ListQuery{Prefix: f.Prefix, State: store.Done, Limit: store.MaxListLimit}) {
		if err != nil {
			return nil, err
		}
		if _, dup := seen[r.Key]; dup || !f.match(r) {
			continue
		}
		seen[r.Key] = struct{}{}
		plan = append(plan, r)
	}
	return plan, nil
}

// ForgetDone forgets the Done records f selects, for a replay after a fix:
// it makes the plan ([Plan]) and, unless dryRun, forgets the records one by
// one with the guarded [store.Forgetter.Forget], each exactly as the plan
// read it, so that a record reclaimed or changed since is skipped, never
// deleted (a claim never is). It returns the report: the plan, and what
// was forgotten and skipped.
//
// It refuses, before any I/O, a filter with neither Prefix nor All
// ([ErrNoPrefix]) or with contradicting fields ([ErrInvalidFilter]). On an
// error from the backend it stops and returns the report so far with the
// error: the records forgotten before it stay forgotten.
func ForgetDone(ctx context.Context, b store.Operator, f Filter, dryRun bool) (Report, error) {
	plan, err := Plan(ctx, b, f)
	if err != nil {
		return Report{}, err
	}
	rep := Report{Plan: plan, DryRun: dryRun}
	if dryRun {
		return rep, nil
	}
	for _, r := range plan {
		ok, err := b.Forget(ctx, r)
		if err != nil {
			return rep, fmt.Errorf("admin: forgetting %q (%d of %d forgotten): %w", r.Key, len(rep.Forgotten), len(plan), err)
		}
		if ok {
			rep.Forgotten = append(rep.Forgotten, r)
		} else {
			rep.Skipped = append(rep.Skipped, r)
		}
	}
	return rep, nil
}

// Purge deletes up to limit records whose expires-at instant has passed
// (zero or less: no limit) and returns how many it deleted, on a backend
// that is a [store.Purger] (SQL, Datastore, Firestore, Spanner, the fake).
// It deletes no record that Claim could still find live. On any other
// backend it returns an error wrapping [ErrNotSupported]: Redis deletes
// expired records itself.
func Purge(ctx context.Context, b store.Backend, limit int) (int, error) {
	p, ok := b.(store.Purger)
	if !ok {
		return 0, fmt.Errorf("%w: %T does not purge (its store expires records itself)", ErrNotSupported, b)
	}
	n, err := p.PurgeExpired(ctx, limit)
	if err != nil {
		return n, fmt.Errorf("admin: purging: %w", err)
	}
	return n, nil
}
