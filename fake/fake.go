// Package fake provides [Store], an in-memory backend for unit tests and
// local development, with an injectable clock ([Clock], [WithClock]) and
// fault injection: calls that fail without effect ([Store.FailNext]), and
// calls whose reply is lost after they took effect ([Store.LoseNextReply],
// [Store.CutConnections]), as on a network.
//
// Store follows the [store.Backend] contract exactly (the
// [github.com/gcp-pubsub-idempotency/idempotency/store/storetest] suite runs
// against it), so a handler tested on it behaves the same on Datastore,
// Redis or SQL. It keeps its records in one process: it de-duplicates deliveries
// that reach the same process only.
package fake

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Op names a Store method, for fault injection.
type Op int

// The operations a fault can be injected into.
const (
	OpClaim Op = iota + 1
	OpComplete
	OpRelease
	OpExtend
)

// String returns the method name.
func (o Op) String() string {
	switch o {
	case OpClaim:
		return "Claim"
	case OpComplete:
		return "Complete"
	case OpRelease:
		return "Release"
	case OpExtend:
		return "Extend"
	case OpCompleteTx:
		return "CompleteTx"
	case OpInspect:
		return "Inspect"
	case OpList:
		return "List"
	case OpForceRelease:
		return "ForceRelease"
	case OpForget:
		return "Forget"
	}
	return "Op(" + strconv.Itoa(int(o)) + ")"
}

// ErrReplyLost is what a call returns when [Store.LoseNextReply] or
// [Store.CutConnections] lost its reply. The call may have taken effect: the caller cannot know,
// exactly as after a network failure.
var ErrReplyLost = errors.New("fake: reply lost")

// Record is a snapshot of one stored record, for assertions in tests.
type Record struct {
	State       store.State
	Fence       int64
	Token       string
	LeaseExpiry time.Time
	ExpiresAt   time.Time
	// Fingerprint is the payload fingerprint that
	// [Store.CompleteFingerprint] stored when it moved the record to Done;
	// empty when none was given, and cleared when the record is reclaimed.
	Fingerprint string
}

// Option configures a [Store] built by [New].
type Option func(*Store)

// WithTTL sets how long a completed key suppresses duplicates (and how long
// a Claimed record outlives its lease). The default is [store.DefaultTTL].
// [New] panics if ttl is not positive. Any positive ttl and lease is
// honoured to the nanosecond, as the port's arithmetic ([store.Instant])
// adds them: an instant after [store.MaxInstant] is capped at it, which
// math.MaxInt64 for both (about 584 years) does not reach.
func WithTTL(ttl time.Duration) Option {
	return func(s *Store) { s.ttl = ttl }
}

// WithClock makes the Store read time from now instead of [time.Now]. A
// *[Clock]'s [Clock.Now] method fits.
func WithClock(now func() time.Time) Option {
	return func(s *Store) { s.now = now }
}

// Store is an in-memory [store.Backend], [store.Extender], [store.Purger],
// [store.Fingerprinter] and [store.Operator]. It is safe for concurrent use. The zero value is ready to
// use with [store.DefaultTTL] and the system clock.
type Store struct {
	ttl time.Duration
	now func() time.Time

	mu     sync.Mutex
	recs   map[string]*Record
	tokens int64
	faults map[Op][]error
	calls  map[Op]int
	lose   bool

	// cuts counts CutConnections calls; a call that sees it change while it
	// runs fails.
	cuts atomic.Int64
}

var (
	_ store.Backend  = (*Store)(nil)
	_ store.Extender = (*Store)(nil)
	_ store.Purger   = (*Store)(nil)

	_ store.Fingerprinter = (*Store)(nil)
)

// New returns an empty Store. It panics if an option is invalid (a
// non-positive ttl): that is a mistake in the test, not in the data.
func New(opts ...Option) *Store {
	s := &Store{}
	for _, o := range opts {
		o(s)
	}
	if s.ttl != 0 {
		if err := store.ValidateTTL(s.ttl); err != nil {
			panic("fake.New: " + err.Error())
		}
	}
	return s
}

// TTL returns the ttl the Store applies.
func (s *Store) TTL() time.Duration {
	if s.ttl == 0 {
		return store.DefaultTTL
	}
	return s.ttl
}

func (s *Store) clock() time.Time {
	if s.now == nil {
		return time.Now()
	}
	return s.now()
}

// FailNext makes the next call of op return err without touching any
// record. Several calls queue up in order.
func (s *Store) FailNext(op Op, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.faults == nil {
		s.faults = make(map[Op][]error)
	}
	s.faults[op] = append(s.faults[op], err)
}

// LoseNextReply makes the next call of Claim, Complete, Release, Extend
// or an operation ([Store.Inspect], [Store.List], [Store.ForceRelease],
// [Store.Forget]) take effect and then return an error wrapping [ErrReplyLost] instead of
// its result, as when a network loses a reply after the server applied the
// request. A caller that retries must find its own earlier effect. Together
// with [Store.CutConnections] it makes *Store a storetest.Faults.
func (s *Store) LoseNextReply() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lose = true
}

// CutConnections fails every call in flight, as a cut network path would:
// a call still waiting for the Store fails without effect, and a call that
// is applying its change keeps the change but loses its reply (an error
// wrapping [ErrReplyLost]). Later calls work.
func (s *Store) CutConnections() {
	s.cuts.Add(1)
}

// Calls returns how many times op was called, including failed calls.
func (s *Store) Calls(op Op) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[op]
}

// Record returns a snapshot of the record for key, and whether one exists.
// A record past its expires-at instant still shows until a Claim replaces it
// or [Store.PurgeExpired] removes it, as in a real store.
func (s *Store) Record(key string) (Record, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.recs[key]
	if !ok {
		return Record{}, false
	}
	return *r, true
}

// Len returns how many records the Store holds.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.recs)
}

// begin counts the call, checks ctx and pops an injected fault. It is
// called with s.mu held; cut is what s.cuts read before the call took the
// lock.
func (s *Store) begin(ctx context.Context, op Op, cut int64) error {
	if s.calls == nil {
		s.calls = make(map[Op]int)
	}
	s.calls[op]++
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("fake: %v: %w", op, err)
	}
	if q := s.faults[op]; len(q) > 0 {
		s.faults[op] = q[1:]
		return q[0]
	}
	if s.cuts.Load() != cut {
		return fmt.Errorf("fake: %v: connection cut before the call arrived: %w", op, ErrReplyLost)
	}
	return nil
}

// reply reports whether the reply of a call that took effect is lost. It
// is called with s.mu held.
func (s *Store) reply(op Op, cut int64) error {
	if s.lose {
		s.lose = false
		return fmt.Errorf("fake: %v: %w", op, ErrReplyLost)
	}
	if s.cuts.Load() != cut {
		return fmt.Errorf("fake: %v: connection cut after the call took effect: %w", op, ErrReplyLost)
	}
	return nil
}

// Claim implements [store.Backend].
func (s *Store) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Result{}, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return store.Result{}, err
	}
	cut := s.cuts.Load()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.begin(ctx, OpClaim, cut); err != nil {
		return store.Result{}, err
	}
	res := s.claim(key, lease)
	if err := s.reply(OpClaim, cut); err != nil {
		return store.Result{}, err
	}
	return res, nil
}

func (s *Store) claim(key string, lease time.Duration) store.Result {
	now := s.clock()
	r, ok := s.recs[key]
	switch {
	case !ok:
		r = &Record{}
		if s.recs == nil {
			s.recs = make(map[string]*Record)
		}
		s.recs[key] = r
	case r.State == store.Done && now.Before(r.ExpiresAt):
		return store.Result{Outcome: store.AlreadyDone, Until: r.ExpiresAt, Fingerprint: r.Fingerprint}
	case r.State == store.Claimed && now.Before(r.LeaseExpiry):
		return store.Result{Outcome: store.HeldByOther, Until: r.LeaseExpiry}
	}
	s.tokens++
	r.State = store.Claimed
	r.Fence++
	var buf [32]byte // one allocation for the token, not two
	r.Token = string(strconv.AppendInt(append(buf[:0], "fake-"...), s.tokens, 10))
	r.LeaseExpiry = store.Instant(now, 0, lease)
	r.ExpiresAt = store.Instant(r.LeaseExpiry, 0, s.TTL())
	r.Fingerprint = ""
	return store.Result{
		Outcome: store.Won,
		Claim:   store.Claim{Key: key, Fence: r.Fence, Token: r.Token, LeaseExpiry: r.LeaseExpiry},
	}
}

// Complete implements [store.Backend].
func (s *Store) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return s.CompleteFingerprint(ctx, c, "")
}

// CompleteFingerprint implements [store.Fingerprinter]: it is Complete
// that also stores fp in the record it moves to Done. Faults injected for
// [OpComplete] apply to it as to Complete.
func (s *Store) CompleteFingerprint(ctx context.Context, c store.Claim, fp string) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	if err := store.ValidateFingerprint(fp); err != nil {
		return false, err
	}
	cut := s.cuts.Load()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.begin(ctx, OpComplete, cut); err != nil {
		return false, err
	}
	ok := s.complete(c, fp)
	if err := s.reply(OpComplete, cut); err != nil {
		return false, err
	}
	return ok, nil
}

func (s *Store) complete(c store.Claim, fp string) bool {
	r, ok := s.recs[c.Key]
	if !ok || r.Fence != c.Fence || r.Token != c.Token {
		return false
	}
	if r.State == store.Claimed {
		r.State = store.Done
		r.ExpiresAt = store.Instant(s.clock(), 0, s.TTL())
		r.Fingerprint = fp
	}
	return true
}

// Release implements [store.Backend].
func (s *Store) Release(ctx context.Context, c store.Claim) error {
	if err := store.ValidateKey(c.Key); err != nil {
		return err
	}
	cut := s.cuts.Load()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.begin(ctx, OpRelease, cut); err != nil {
		return err
	}
	r, ok := s.recs[c.Key]
	if ok && r.State == store.Claimed && r.Fence == c.Fence && r.Token == c.Token {
		r.Fence++
		r.LeaseExpiry = s.clock()
		r.ExpiresAt = store.Instant(r.LeaseExpiry, 0, s.TTL())
	}
	return s.reply(OpRelease, cut)
}

// Extend implements [store.Extender].
func (s *Store) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return c, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return c, err
	}
	cut := s.cuts.Load()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.begin(ctx, OpExtend, cut); err != nil {
		return c, err
	}
	r, ok := s.recs[c.Key]
	if !ok || r.State != store.Claimed || r.Fence != c.Fence || r.Token != c.Token {
		if err := s.reply(OpExtend, cut); err != nil {
			return c, err
		}
		return c, fmt.Errorf("fake: extend %q fence %d: %w", c.Key, c.Fence, store.ErrLost)
	}
	r.LeaseExpiry = store.Instant(s.clock(), 0, lease)
	r.ExpiresAt = store.Instant(r.LeaseExpiry, 0, s.TTL())
	if err := s.reply(OpExtend, cut); err != nil {
		return c, err
	}
	c.LeaseExpiry = r.LeaseExpiry
	return c, nil
}

// PurgeExpired implements [store.Purger].
func (s *Store) PurgeExpired(ctx context.Context, limit int) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("fake: PurgeExpired: %w", err)
	}
	now := s.clock()
	n := 0
	for k, r := range s.recs {
		if limit > 0 && n >= limit {
			break
		}
		if !now.Before(r.ExpiresAt) {
			delete(s.recs, k)
			n++
		}
	}
	return n, nil
}

// Clock is a manual clock for tests: it stands still until [Clock.Advance]
// or [Clock.Set] moves it. It is safe for concurrent use.
type Clock struct {
	mu  sync.Mutex
	now time.Time
}

// NewClock returns a Clock that reads start.
func NewClock(start time.Time) *Clock {
	return &Clock{now: start}
}

// Now returns the clock's current time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock forward by d (backward when d is negative).
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// Set moves the clock to t.
func (c *Clock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = t
}
