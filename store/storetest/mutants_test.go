package storetest_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path"
	"regexp"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// mutants maps each deliberate bug to the cases named after the rule it
// breaks: the suite must fail every one of them on that mutant (it may fail
// more). Together they cover every MUST rule of the port, every row of the
// transition table, the instants where a lease and a ttl end, key fidelity
// up to store.MaxKeyLen, the optional interfaces, and retry safety under
// lost replies and cut connections.
var mutants = map[string][]string{
	// Arguments are validated by every method.
	"accepts an empty key":                                 {"invalid_keys_are_refused"},
	"accepts a NUL byte":                                   {"invalid_keys_are_refused"},
	"accepts keys longer than MaxKeyLen":                   {"invalid_keys_are_refused"},
	"accepts a non-positive lease":                         {"non_positive_leases_are_refused"},
	"complete does not validate its key":                   {"invalid_keys_are_refused"},
	"release does not validate its key":                    {"invalid_keys_are_refused"},
	"extend does not validate its key":                     {"invalid_keys_are_refused"},
	"extend does not validate its lease":                   {"extend_renews_only_the_current_claim"},
	"claim ignores a cancelled ctx":                        {"a_cancelled_context_fails_and_changes_nothing"},
	"complete ignores a cancelled ctx":                     {"a_cancelled_context_fails_and_changes_nothing"},
	"release ignores a cancelled ctx":                      {"a_cancelled_context_fails_and_changes_nothing"},
	"extend ignores a cancelled ctx":                       {"a_cancelled_context_fails_and_changes_nothing"},
	"purge ignores a cancelled ctx":                        {"a_cancelled_context_fails_and_changes_nothing"},
	"the ctx error is not wrapped":                         {"a_cancelled_context_fails_and_changes_nothing"},
	"truncates keys at 1000 bytes":                         {"keys_are_stored_verbatim_and_kept_apart"},
	"truncates keys at 512 bytes":                          {"keys_are_stored_verbatim_and_kept_apart"},
	"folds case":                                           {"keys_are_stored_verbatim_and_kept_apart"},
	"trims spaces":                                         {"keys_are_stored_verbatim_and_kept_apart"},
	"replaces invalid UTF-8":                               {"keys_are_stored_verbatim_and_kept_apart"},
	"normalises Unicode":                                   {"keys_are_stored_verbatim_and_kept_apart"},
	"cleans key paths":                                     {"keys_are_stored_verbatim_and_kept_apart"},
	"absent: the fence starts at 0":                        {"claim_on_an_absent_key_wins_with_fence_1"},
	"claimed: a claim steals a live lease":                 {"claim_during_a_live_lease_is_held_by_other"},
	"claimed: a held claim raises the fence":               {"claim_during_a_live_lease_is_held_by_other"},
	"claimed: held-by-other Until is wrong":                {"claim_during_a_live_lease_is_held_by_other"},
	"claimed: a lapsed lease is never reclaimed":           {"claim_after_the_lease_lapsed_reclaims_with_fence_plus_1"},
	"claimed: a reclaim restarts the fence at 1":           {"claim_after_the_lease_lapsed_reclaims_with_fence_plus_1"},
	"the token is derived from the key":                    {"claim_after_the_lease_lapsed_reclaims_with_fence_plus_1"},
	"the lease ends one nanosecond late":                   {"claim_at_exactly_the_lease_expiry_wins_one_nanosecond_before_is_held"},
	"the lease ends one nanosecond early":                  {"claim_at_exactly_the_lease_expiry_wins_one_nanosecond_before_is_held"},
	"the lease is shorter than asked":                      {"claim_at_exactly_the_lease_expiry_wins_one_nanosecond_before_is_held"},
	"the lease expiry reported is not the one stored":      {"claim_on_an_absent_key_wins_with_fence_1", "claim_at_exactly_the_lease_expiry_wins_one_nanosecond_before_is_held"},
	"the record dies with its lease":                       {"claim_after_the_lease_lapsed_reclaims_with_fence_plus_1", "a_claimed_record_outlives_its_lease_by_the_ttl"},
	"a claimed record expires ttl after the claim":         {"a_claimed_record_outlives_its_lease_by_the_ttl"},
	"complete ignores the fence":                           {"zombie_cannot_complete_over_a_newer_claim"},
	"complete matches the fence but not the token":         {"a_claim_from_before_its_record_was_deleted_cannot_touch_the_new_record"},
	"release matches the fence but not the token":          {"a_claim_from_before_its_record_was_deleted_cannot_touch_the_new_record"},
	"extend matches the fence but not the token":           {"a_claim_from_before_its_record_was_deleted_cannot_touch_the_new_record"},
	"complete takes a token that begins with the holder's": {"a_claim_whose_token_only_resembles_the_holders_touches_nothing"},
	"complete compares the token by a collation":           {"a_claim_whose_token_only_resembles_the_holders_touches_nothing"},
	"release takes a token that begins with the holder's":  {"a_claim_whose_token_only_resembles_the_holders_touches_nothing"},
	"extend takes a token that begins with the holder's":   {"a_claim_whose_token_only_resembles_the_holders_touches_nothing"},
	"complete requires a live lease":                       {"complete_commits_after_the_lease_lapsed_if_nobody_reclaimed"},
	"complete answers true without marking done":           {"complete_with_the_current_fence_marks_done"},
	"complete of a done key answers false":                 {"complete_and_release_on_a_done_key_are_idempotent", "a_complete_whose_reply_was_lost_is_safe_to_retry"},
	"complete creates a missing record":                    {"complete_and_release_without_a_record_change_nothing"},
	"done: a done key is not suppressed":                   {"claim_of_a_done_key_within_the_ttl_is_already_done"},
	"done: a done key never expires":                       {"claim_of_a_done_key_after_the_ttl_wins_again"},
	"done: the ttl is one nanosecond short":                {"the_ttl_runs_from_completion_and_ends_exactly_at_completion_plus_ttl"},
	"done: the ttl counts from the claim":                  {"the_ttl_runs_from_completion_and_ends_exactly_at_completion_plus_ttl"},
	"done: the ttl counts from the lease expiry":           {"the_ttl_runs_from_completion_and_ends_exactly_at_completion_plus_ttl"},
	"done: a second complete restarts the ttl":             {"the_ttl_runs_from_completion_and_ends_exactly_at_completion_plus_ttl"},
	"done: already-done Until is wrong":                    {"claim_of_a_done_key_within_the_ttl_is_already_done", "the_ttl_runs_from_completion_and_ends_exactly_at_completion_plus_ttl"},
	"release deletes the record":                           {"release_makes_the_key_reclaimable_at_once_with_a_higher_fence", "mutex_cycle_reclaims_forever_without_ever_completing"},
	"release keeps the fence":                              {"released_claim_can_never_complete", "mutex_cycle_reclaims_forever_without_ever_completing"},
	"release keeps the lease":                              {"release_makes_the_key_reclaimable_at_once_with_a_higher_fence"},
	"release raises the fence twice":                       {"release_makes_the_key_reclaimable_at_once_with_a_higher_fence"},
	"release ignores the fence":                            {"zombie_release_does_not_disturb_the_newer_claim"},
	"release reopens a done key":                           {"complete_and_release_on_a_done_key_are_idempotent"},
	"a released record expires at once":                    {"a_released_record_outlives_the_release_by_the_ttl"},
	"a retried release fails":                              {"a_release_whose_reply_was_lost_is_safe_to_retry"},
	"extend changes the fence":                             {"extend_renews_only_the_current_claim"},
	"extend revives a stale claim":                         {"extend_renews_only_the_current_claim"},
	"extend of a done claim succeeds":                      {"extend_renews_only_the_current_claim"},
	"extend requires a live lease":                         {"extend_renews_only_the_current_claim"},
	"extend counts from the old lease expiry":              {"extend_renews_only_the_current_claim"},
	"extend keeps the old expires-at":                      {"an_extended_record_outlives_its_new_lease_by_the_ttl"},
	"purge deletes live claims":                            {"purge_removes_only_expired_records"},
	"purge deletes lapsed claims":                          {"purge_removes_only_expired_records"},
	"purge deletes one nanosecond early":                   {"purge_removes_only_expired_records"},
	"purge ignores the limit":                              {"purge_removes_only_expired_records"},
	"claims race between read and write":                   {"racing_claims_on_a_fresh_key_admit_exactly_one", "racing_reclaims_on_a_lapsed_key_admit_exactly_one", "racing_claims_on_an_expired_done_key_admit_exactly_one_the_others_are_held"},
	"a loser answers from a stale snapshot":                {"racing_claims_on_an_expired_done_key_admit_exactly_one_the_others_are_held"},
	"a retried claim takes a new token":                    {"a_claim_whose_reply_was_lost_is_won_or_an_error_never_held_or_done"},
	"a retried claim raises the fence again":               {"a_claim_whose_reply_was_lost_is_won_or_an_error_never_held_or_done"},
	"complete answers true when its reply was lost":        {"a_complete_whose_reply_was_lost_is_safe_to_retry"},
	"a cut claim reports won without writing":              {"calls_cut_mid_flight_win_nothing_twice_and_converge"},

	// A server clock that jumps (Harness.ServerClock): the mutant's clock
	// is its server's, and its client's clock is that minus every jump.
	"writes trust a server-time estimate from before a jump": {
		"a_claim_won_after_the_server_clock_jumped_is_held_for_its_lease",
		"a_key_completed_after_the_server_clock_jumped_is_done_for_its_ttl",
	},
	"every instant comes from the client's clock": {
		"a_claim_won_after_the_server_clock_jumped_is_held_for_its_lease",
		"a_key_completed_after_the_server_clock_jumped_is_done_for_its_ttl",
	},
	// Durations at the limit of time.Duration, rounded up to milliseconds
	// the usual way, (d + ms - 1) / ms, which wraps into the past.
	"a lease at its limit wraps into the past":   {"leases_at_their_limit_never_expire_a_claim_early"},
	"an extend at its limit wraps into the past": {"extends_at_their_limit_never_expire_a_claim_early"},
	"a ttl at its limit wraps into the past":     {"ttls_at_their_limit_never_expire_a_record_early"},

	// Payload fingerprints (store.Fingerprinter).
	"complete with a fingerprint drops it":                    {"a_fingerprint_stored_by_complete_is_reported_while_the_key_is_done", "fingerprints_are_stored_verbatim_up_to_MaxFingerprintLen"},
	"a complete with a fingerprint counts the ttl from claim": {"a_fingerprint_stored_by_complete_is_reported_while_the_key_is_done"},
	"a reclaim keeps the old fingerprint":                     {"a_reclaim_after_the_ttl_leaves_no_fingerprint_behind"},
	"every outcome reports the stored fingerprint":            {"a_reclaim_after_the_ttl_leaves_no_fingerprint_behind"},
	"a retried complete overwrites the fingerprint":           {"a_retried_complete_with_the_same_fence_keeps_the_first_fingerprint"},
	"a retried complete fills in a missing fingerprint":       {"a_plain_complete_stores_no_fingerprint"},
	"a stale complete stores its fingerprint":                 {"a_stale_or_released_claim_stores_no_fingerprint"},
	"fingerprints are not validated":                          {"invalid_fingerprints_are_refused_and_change_nothing"},
	"fingerprints are validated only on claimed records":      {"invalid_fingerprints_are_refused_and_change_nothing"},
	"fingerprints are truncated at 64 bytes":                  {"fingerprints_are_stored_verbatim_up_to_MaxFingerprintLen"},
	"fingerprints are trimmed":                                {"fingerprints_are_stored_verbatim_up_to_MaxFingerprintLen"},
	"a lost complete drops the fingerprint on retry":          {"a_complete_with_a_fingerprint_whose_reply_was_lost_is_safe_to_retry"},
}

// mutant is an in-memory backend that follows the port except for one
// deliberate bug, named by bug ("" for none). It behaves like a networked
// backend: it implements storetest.Faults, and a Claim whose reply is lost
// retries once with the same token and recognises its own claim.
type mutant struct {
	bug   string
	clock *fake.Clock
	ttl   time.Duration

	mu     sync.Mutex
	recs   map[string]*rec
	tokens int
	lose   bool

	cuts atomic.Int64 // calls still to fail after CutConnections

	// jumped is how far the server's clock (clock) has jumped away from the
	// client's; est is the estimate of that a write trusts, once made.
	jumped, est time.Duration
	estSet      bool
}

// Jump moves the server's clock by d; the client's clock stays.
func (m *mutant) Jump(d time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.jumped += d
	m.clock.Advance(d)
}

// now is the instant a call judges by, with m.mu held: the server's clock.
func (m *mutant) now() time.Time {
	if m.is("every instant comes from the client's clock") {
		return m.clock.Now().Add(-m.jumped)
	}
	return m.clock.Now()
}

// writeBase is the instant a write bases a lease or a ttl on, with m.mu
// held: now, but for the mutant that estimates the server's time once and
// trusts that estimate from then on.
func (m *mutant) writeBase(now time.Time) time.Time {
	if !m.is("writes trust a server-time estimate from before a jump") {
		return now
	}
	if !m.estSet {
		m.est, m.estSet = m.jumped, true
	}
	return now.Add(m.est - m.jumped)
}

type rec struct {
	state     store.State
	fence     int64
	token     string
	claimedAt time.Time
	lease     time.Time // lease expiry
	expiry    time.Time // expires-at
	fp        string    // payload fingerprint of a Done record
}

var (
	_ store.Backend  = (*mutant)(nil)
	_ store.Extender = (*mutant)(nil)
	_ store.Purger   = (*mutant)(nil)

	_ store.Fingerprinter = (*mutant)(nil)
	_ storetest.Faults    = (*mutant)(nil)
)

var errLost = errors.New("mutant: reply lost")

func (m *mutant) is(bug string) bool { return m.bug == bug }

// tokenMatches reports whether verb (complete, release or extend) takes the
// caller's token for the record's: equal, or, for the "<verb> takes a token
// that begins with the holder's" mutants, merely beginning with it (a
// record format that ends the token at a separator and ignores the rest,
// as redislock's done value did for a moment).
func (m *mutant) tokenMatches(stored, given, verb string) bool {
	if m.is(verb + " takes a token that begins with the holder's") {
		return strings.HasPrefix(given, stored)
	}
	if m.is(verb + " compares the token by a collation") {
		// MySQL's VARCHAR: no case, and on MariaDB no trailing spaces.
		return strings.EqualFold(strings.TrimRight(stored, " "), strings.TrimRight(given, " "))
	}
	return stored == given
}

func (m *mutant) LoseNextReply() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.lose = true
}

func (m *mutant) CutConnections() { m.cuts.Add(3) }

func (m *mutant) takeCut() bool {
	for {
		n := m.cuts.Load()
		if n <= 0 {
			return false
		}
		if m.cuts.CompareAndSwap(n, n-1) {
			return true
		}
	}
}

// cutBefore reports whether this call fails before reaching the records.
func (m *mutant) cutBefore() bool { return rand.IntN(2) == 0 && m.takeCut() }

// replyLost reports, with m.mu held, whether the reply of a call that took
// effect is lost.
func (m *mutant) replyLost() bool {
	if m.lose {
		m.lose = false
		return true
	}
	return m.takeCut()
}

func (m *mutant) validKey(key string, skip bool) error {
	if skip {
		return nil
	}
	switch {
	case key == "" && !m.is("accepts an empty key"):
		return store.ErrInvalidKey
	case strings.IndexByte(key, 0) >= 0 && !m.is("accepts a NUL byte"):
		return store.ErrInvalidKey
	case len(key) > store.MaxKeyLen && !(m.is("accepts keys longer than MaxKeyLen") && len(key) <= 2*store.MaxKeyLen):
		return store.ErrInvalidKey
	}
	return nil
}

func (m *mutant) ctxErr(ctx context.Context, ignore bool) error {
	if ignore || ctx.Err() == nil {
		return nil
	}
	if m.is("the ctx error is not wrapped") {
		return fmt.Errorf("mutant: %v", ctx.Err())
	}
	return fmt.Errorf("mutant: %w", ctx.Err())
}

// canon is where the key-fidelity bugs live: the record's storage key.
func (m *mutant) canon(key string) string {
	switch m.bug {
	case "truncates keys at 1000 bytes":
		return key[:min(len(key), 1000)]
	case "truncates keys at 512 bytes":
		return key[:min(len(key), 512)]
	case "folds case":
		return strings.ToLower(key)
	case "trims spaces":
		return strings.TrimSpace(key)
	case "replaces invalid UTF-8":
		return strings.ToValidUTF8(key, "\uFFFD")
	case "normalises Unicode":
		return strings.ReplaceAll(key, "e\u0301", "\u00e9")
	case "cleans key paths":
		return path.Clean(key)
	}
	return key
}

func (m *mutant) newToken(key string) string {
	if m.is("the token is derived from the key") {
		return "token-" + key
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.tokens++
	return fmt.Sprintf("token-%d", m.tokens)
}

// wrapped is d rounded up to whole milliseconds the way that overflows:
// within a millisecond of math.MaxInt64 it wraps to a negative duration.
func wrapped(d time.Duration) time.Duration {
	return (d + time.Millisecond - 1) / time.Millisecond * time.Millisecond
}

// keep is the ttl the mutant adds to an instant.
func (m *mutant) keep() time.Duration {
	if m.is("a ttl at its limit wraps into the past") {
		return wrapped(m.ttl)
	}
	return m.ttl
}

// live reports whether a lease that expires at lease is live at now.
func (m *mutant) live(now, lease time.Time) bool {
	switch m.bug {
	case "the lease ends one nanosecond late":
		return !now.After(lease)
	case "the lease ends one nanosecond early":
		return now.Before(lease.Add(-time.Nanosecond))
	}
	return now.Before(lease)
}

func (m *mutant) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	if err := m.validKey(key, false); err != nil {
		return store.Result{}, err
	}
	if lease <= 0 && !m.is("accepts a non-positive lease") {
		return store.Result{}, store.ErrInvalidLease
	}
	if err := m.ctxErr(ctx, m.is("claim ignores a cancelled ctx")); err != nil {
		return store.Result{}, err
	}
	token := m.newToken(key)
	for attempt := 0; ; attempt++ {
		if m.cutBefore() {
			if m.is("a cut claim reports won without writing") {
				m.mu.Lock()
				defer m.mu.Unlock()
				var fence int64 = 1
				if r, ok := m.recs[m.canon(key)]; ok {
					fence = r.fence + 1
				}
				exp := m.clock.Now().Add(lease)
				return store.Result{Outcome: store.Won, Claim: store.Claim{Key: key, Fence: fence, Token: token, LeaseExpiry: exp}}, nil
			}
			return store.Result{}, fmt.Errorf("mutant: claim: connection cut: %w", errLost)
		}
		res, lost := m.claimOnce(key, lease, token)
		if !lost {
			return res, nil
		}
		if attempt > 0 {
			return store.Result{}, fmt.Errorf("mutant: claim: %w", errLost)
		}
		// A networked backend retries a lost reply with the same token.
		if m.is("a retried claim takes a new token") {
			token = m.newToken(key)
		}
	}
}

func (m *mutant) claimOnce(key string, lease time.Duration, token string) (res store.Result, lost bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	ck := m.canon(key)
	now := m.now()
	r, ok := m.recs[ck]
	if m.is("claims race between read and write") || m.is("a loser answers from a stale snapshot") {
		// Read, let go, then write what was decided on the read.
		var snap rec
		if ok {
			snap = *r
		}
		m.mu.Unlock()
		time.Sleep(time.Millisecond)
		m.mu.Lock()
		if m.is("a loser answers from a stale snapshot") {
			cur, curOK := m.recs[ck]
			if curOK != ok || (curOK && (cur.fence != snap.fence || cur.state != snap.state)) {
				// Someone moved on: answer from the snapshot.
				if ok && snap.state == store.Done {
					return store.Result{Outcome: store.AlreadyDone, Until: snap.expiry}, m.replyLost()
				}
				return store.Result{Outcome: store.HeldByOther, Until: cur.lease}, m.replyLost()
			}
		} else if ok {
			cp := snap
			r = &cp
			m.recs[ck] = r
		}
	}
	if ok && m.is("the record dies with its lease") && r.state == store.Claimed && !now.Before(r.lease) {
		ok = false
	}
	if ok && r.state == store.Claimed && r.token == token {
		// An earlier try of this call won and its reply was lost.
		if m.is("a retried claim raises the fence again") {
			r.fence++
		}
		return store.Result{Outcome: store.Won, Claim: store.Claim{Key: key, Fence: r.fence, Token: token, LeaseExpiry: r.lease}}, m.replyLost()
	}
	switch {
	case !ok:
		r = &rec{}
		if m.is("absent: the fence starts at 0") {
			r.fence = -1
		}
		m.recs[ck] = r
	case r.state == store.Done && (now.Before(r.expiry) || m.is("done: a done key never expires")):
		until := r.expiry
		if m.is("done: already-done Until is wrong") {
			until = r.lease.Add(m.keep())
		}
		return store.Result{Outcome: store.AlreadyDone, Until: until, Fingerprint: r.fp}, m.replyLost()
	case r.state == store.Claimed && (m.live(now, r.lease) || m.is("claimed: a lapsed lease is never reclaimed")) && !m.is("claimed: a claim steals a live lease"):
		if m.is("claimed: a held claim raises the fence") {
			r.fence++
		}
		until := r.lease
		if m.is("claimed: held-by-other Until is wrong") {
			until = r.expiry
		}
		return store.Result{Outcome: store.HeldByOther, Until: until, Fingerprint: m.leftover(r)}, m.replyLost()
	}
	r.state, r.token, r.claimedAt = store.Claimed, token, now
	if !m.is("a reclaim keeps the old fingerprint") && !m.is("every outcome reports the stored fingerprint") {
		r.fp = ""
	}
	r.fence++
	if m.is("claimed: a reclaim restarts the fence at 1") {
		r.fence = 1
	}
	r.lease = m.writeBase(now).Add(lease)
	if m.is("a lease at its limit wraps into the past") {
		r.lease = m.writeBase(now).Add(wrapped(lease))
	}
	if m.is("the lease is shorter than asked") {
		r.lease = now.Add(lease * 9 / 10)
	}
	r.expiry = r.lease.Add(m.keep())
	if m.is("a claimed record expires ttl after the claim") {
		r.expiry = now.Add(m.keep())
	}
	reported := r.lease
	if m.is("the lease expiry reported is not the one stored") {
		reported = now.Add(2 * lease)
	}
	return store.Result{Outcome: store.Won, Claim: store.Claim{Key: key, Fence: r.fence, Token: token, LeaseExpiry: reported}, Fingerprint: m.leftover(r)}, m.replyLost()
}

// leftover is the fingerprint a Won or HeldByOther result reports: none,
// but for the mutant that reports the stored one whatever the outcome.
func (m *mutant) leftover(r *rec) string {
	if m.is("every outcome reports the stored fingerprint") {
		return r.fp
	}
	return ""
}

func (m *mutant) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return m.CompleteFingerprint(ctx, c, "")
}

func (m *mutant) CompleteFingerprint(ctx context.Context, c store.Claim, fp string) (bool, error) {
	if err := m.validKey(c.Key, m.is("complete does not validate its key")); err != nil {
		return false, err
	}
	if !m.is("fingerprints are not validated") && !m.is("fingerprints are validated only on claimed records") {
		if err := store.ValidateFingerprint(fp); err != nil {
			return false, err
		}
	}
	if err := m.ctxErr(ctx, m.is("complete ignores a cancelled ctx")); err != nil {
		return false, err
	}
	if m.cutBefore() {
		return false, fmt.Errorf("mutant: complete: connection cut: %w", errLost)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.is("complete answers true when its reply was lost") && m.lose {
		m.lose = false
		return true, nil
	}
	if m.is("fingerprints are validated only on claimed records") {
		if r, ok := m.recs[m.canon(c.Key)]; ok && r.state == store.Claimed {
			if err := store.ValidateFingerprint(fp); err != nil {
				return false, err
			}
		}
	}
	ok := m.complete(c, fp)
	if m.replyLost() {
		if m.is("a lost complete drops the fingerprint on retry") {
			m.recs[m.canon(c.Key)].fp = ""
		}
		return false, fmt.Errorf("mutant: complete: %w", errLost)
	}
	return ok, nil
}

func (m *mutant) complete(c store.Claim, fp string) bool {
	now := m.now()
	ck := m.canon(c.Key)
	r, ok := m.recs[ck]
	if !ok {
		if m.is("complete creates a missing record") {
			m.recs[ck] = &rec{state: store.Done, fence: c.Fence, expiry: now.Add(m.keep())}
			return true
		}
		return false
	}
	if r.fence != c.Fence && !m.is("complete ignores the fence") {
		if m.is("a stale complete stores its fingerprint") && fp != "" {
			r.fp = fp
		}
		return false
	}
	if !m.tokenMatches(r.token, c.Token, "complete") && !m.is("complete ignores the fence") && !m.is("complete matches the fence but not the token") {
		return false
	}
	if r.state == store.Done {
		if m.is("complete of a done key answers false") {
			return false
		}
		if fp != "" && (m.is("a retried complete overwrites the fingerprint") || m.is("a retried complete fills in a missing fingerprint") && r.fp == "") {
			r.fp = fp
		}
		if m.is("done: a second complete restarts the ttl") {
			r.expiry = now.Add(m.keep())
		}
		return true
	}
	if m.is("complete requires a live lease") && !now.Before(r.lease) {
		return false
	}
	if m.is("complete answers true without marking done") {
		return true
	}
	r.state = store.Done
	switch {
	case m.is("complete with a fingerprint drops it"):
		r.fp = ""
	case m.is("fingerprints are truncated at 64 bytes"):
		r.fp = fp[:min(len(fp), 64)]
	case m.is("fingerprints are trimmed"):
		r.fp = strings.TrimSpace(fp)
	case m.is("a reclaim keeps the old fingerprint") && fp == "":
	default:
		r.fp = fp
	}
	if m.is("a complete with a fingerprint counts the ttl from claim") && fp != "" {
		r.expiry = r.claimedAt.Add(m.keep())
		return true
	}
	switch m.bug {
	case "done: a done key is not suppressed":
		r.expiry = now
	case "done: the ttl is one nanosecond short":
		r.expiry = now.Add(m.ttl - time.Nanosecond)
	case "done: the ttl counts from the claim":
		r.expiry = r.claimedAt.Add(m.keep())
	case "done: the ttl counts from the lease expiry":
		r.expiry = r.lease.Add(m.keep())
	default:
		r.expiry = m.writeBase(now).Add(m.keep())
	}
	return true
}

func (m *mutant) Release(ctx context.Context, c store.Claim) error {
	if err := m.validKey(c.Key, m.is("release does not validate its key")); err != nil {
		return err
	}
	if err := m.ctxErr(ctx, m.is("release ignores a cancelled ctx")); err != nil {
		return err
	}
	if m.cutBefore() {
		return fmt.Errorf("mutant: release: connection cut: %w", errLost)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	ck := m.canon(c.Key)
	r, ok := m.recs[ck]
	switch {
	case ok && r.state == store.Done && r.fence == c.Fence && m.is("release reopens a done key"):
		r.state, r.lease = store.Claimed, now
		r.fence++
	case !ok || r.state != store.Claimed:
	case r.fence != c.Fence && !m.is("release ignores the fence"):
		if m.is("a retried release fails") {
			return fmt.Errorf("mutant: release of fence %d: %w", c.Fence, store.ErrLost)
		}
	case !m.tokenMatches(r.token, c.Token, "release") && !m.is("release ignores the fence") && !m.is("release matches the fence but not the token"):
		if m.is("a retried release fails") {
			return fmt.Errorf("mutant: release of fence %d: %w", c.Fence, store.ErrLost)
		}
	case m.is("release deletes the record"):
		delete(m.recs, ck)
	default:
		switch m.bug {
		case "release keeps the fence":
		case "release raises the fence twice":
			r.fence += 2
		default:
			r.fence++
		}
		if !m.is("release keeps the lease") {
			r.lease = now
		}
		r.expiry = now.Add(m.keep())
		if m.is("a released record expires at once") {
			r.expiry = now
		}
	}
	if m.replyLost() {
		return fmt.Errorf("mutant: release: %w", errLost)
	}
	return nil
}

func (m *mutant) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	if err := m.validKey(c.Key, m.is("extend does not validate its key")); err != nil {
		return c, err
	}
	if lease <= 0 && !m.is("extend does not validate its lease") {
		return c, store.ErrInvalidLease
	}
	if err := m.ctxErr(ctx, m.is("extend ignores a cancelled ctx")); err != nil {
		return c, err
	}
	if m.cutBefore() {
		return c, fmt.Errorf("mutant: extend: connection cut: %w", errLost)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	r, ok := m.recs[m.canon(c.Key)]
	switch {
	case !ok:
		return c, store.ErrLost
	case r.state == store.Done && !(m.is("extend of a done claim succeeds") && r.fence == c.Fence):
		return c, store.ErrLost
	case r.fence != c.Fence && !m.is("extend revives a stale claim"):
		return c, store.ErrLost
	case !m.tokenMatches(r.token, c.Token, "extend") && !m.is("extend revives a stale claim") && !m.is("extend matches the fence but not the token"):
		return c, store.ErrLost
	case m.is("extend requires a live lease") && !now.Before(r.lease):
		return c, store.ErrLost
	}
	if m.is("extend counts from the old lease expiry") {
		r.lease = r.lease.Add(lease)
	} else if m.is("an extend at its limit wraps into the past") {
		r.lease = now.Add(wrapped(lease))
	} else {
		r.lease = m.writeBase(now).Add(lease)
	}
	if !m.is("extend keeps the old expires-at") {
		r.expiry = r.lease.Add(m.keep())
	}
	if m.is("extend changes the fence") {
		r.fence++
	}
	if m.replyLost() {
		return c, fmt.Errorf("mutant: extend: %w", errLost)
	}
	c.Fence, c.LeaseExpiry = r.fence, r.lease
	return c, nil
}

func (m *mutant) PurgeExpired(ctx context.Context, limit int) (int, error) {
	if err := m.ctxErr(ctx, m.is("purge ignores a cancelled ctx")); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	n := 0
	for k, r := range m.recs {
		if limit > 0 && n >= limit && !m.is("purge ignores the limit") {
			break
		}
		expired := !now.Before(r.expiry)
		switch m.bug {
		case "purge deletes live claims":
			expired = expired || r.state == store.Claimed && now.Before(r.lease)
		case "purge deletes lapsed claims":
			expired = expired || r.state == store.Claimed && !now.Before(r.lease)
		case "purge deletes one nanosecond early":
			expired = !now.Before(r.expiry.Add(-time.Nanosecond))
		}
		if expired {
			delete(m.recs, k)
			n++
		}
	}
	return n, nil
}

// excluded are cases the mutant runs leave out: the history check has a
// mutation test of its own.
const excluded = "^TestMutant/concurrent_histories"

// TestMutant runs the suite on the mutant that STORETEST_MUTANT names. It
// does nothing unless TestSuiteCatchesMutants starts it.
func TestMutant(t *testing.T) {
	bug, ok := os.LookupEnv("STORETEST_MUTANT")
	if !ok {
		t.Skip("run by TestSuiteCatchesMutants, one process per mutant")
	}
	if _, known := mutants[bug]; !known && bug != "" {
		t.Fatalf("unknown mutant %q", bug)
	}
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		clock := fake.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
		m := &mutant{bug: bug, clock: clock, ttl: time.Hour, recs: map[string]*rec{}}
		return storetest.Harness{
			Backend: m,
			TTL:     m.ttl,
			Advance: clock.Advance,
			Now:     clock.Now,
			Faults:  m,
			ServerClock: func(t *testing.T) storetest.JumpHarness {
				clock := fake.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
				m := &mutant{bug: bug, clock: clock, ttl: time.Hour, recs: map[string]*rec{}}
				return storetest.JumpHarness{
					Harness: storetest.Harness{Backend: m, TTL: m.ttl, Advance: clock.Advance, Now: clock.Now, Faults: m},
					Jump:    m.Jump,
				}
			},
			WithTTL: func(ttl time.Duration) store.Backend {
				return &mutant{bug: bug, clock: clock, ttl: ttl, recs: map[string]*rec{}}
			},
		}
	})
}

// TestSuiteCatchesMutants runs the suite on every mutant, each in a process
// of its own: every mutant must fail the cases named after the rule it
// breaks, and the mutant with no bug must fail none.
func TestSuiteCatchesMutants(t *testing.T) {
	if os.Getenv("STORETEST_MUTANT") != "" {
		t.Skip("inside a mutant run")
	}
	failLine := regexp.MustCompile(`--- FAIL: TestMutant/(\S+)`)
	passLine := regexp.MustCompile(`--- (?:PASS|SKIP): TestMutant/(\S+)`)
	bugs := []string{""}
	for bug := range mutants {
		bugs = append(bugs, bug)
	}
	sort.Strings(bugs)
	// The runs wait on sleeps more than on the CPU: more of them at once
	// than -test.parallel allows.
	type run struct {
		out []byte
		err error
	}
	runs := make([]run, len(bugs))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 6)
	for i, bug := range bugs {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			cmd := exec.Command(os.Args[0], "-test.run=^TestMutant$", "-test.skip="+excluded, "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), "STORETEST_MUTANT="+bug)
			runs[i].out, runs[i].err = cmd.CombinedOutput()
		})
	}
	wg.Wait()
	killed := 0
	for i, bug := range bugs {
		name := bug
		if name == "" {
			name = "no bug"
		}
		out, err := runs[i].out, runs[i].err
		t.Run(name, func(t *testing.T) {
			failed := map[string]bool{}
			for _, m := range failLine.FindAllStringSubmatch(string(out), -1) {
				failed[m[1]] = true
			}
			ran := len(passLine.FindAllString(string(out), -1)) + len(failed)
			if ran < 20 {
				t.Fatalf("the suite ran only %d cases: %v\n%s", ran, err, out)
			}
			if bug == "" {
				if err != nil || len(failed) > 0 {
					t.Fatalf("the correct backend failed %v: %v\n%s", keys(failed), err, out)
				}
				return
			}
			if err == nil {
				t.Fatalf("the suite passed a backend whose bug is: %s", bug)
			}
			ok := true
			for _, w := range mutants[bug] {
				if !failed[w] {
					ok = false
					t.Errorf("%s did not fail; failed: %v", w, keys(failed))
				}
			}
			if ok {
				killed++
			}
			t.Logf("mutant %q failed %v", bug, keys(failed))
		})
	}
	t.Logf("mutants killed: %d of %d", killed, len(mutants))
}

func keys(m map[string]bool) []string {
	var s []string
	for k := range m {
		s = append(s, k)
	}
	sort.Strings(s)
	return s
}
