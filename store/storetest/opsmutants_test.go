package storetest_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// opsMutants maps each deliberate bug of the operations (store.Operator)
// to the RunOps cases named after the rule it breaks: the suite must fail
// every one of them on that mutant (it may fail more). The mutant is
// mutant (mutants_test.go) with the methods below.
var opsMutants = map[string][]string{
	// Inspect.
	"inspect reports the raw token as version":       {"inspect_reports_the_stored_record_its_version_and_the_backend_now"},
	"inspect reports the version of the key":         {"inspect_reports_the_stored_record_its_version_and_the_backend_now", "force_release_of_a_stale_or_missing_record_is_false_and_changes_nothing"},
	"inspect bumps the fence":                        {"inspect_and_list_change_nothing"},
	"inspect deletes reclaimable records":            {"inspect_and_list_change_nothing", "inspect_reports_lapsed_and_expired_records_as_stored"},
	"inspect hides expired records":                  {"inspect_reports_lapsed_and_expired_records_as_stored"},
	"inspect reports the client's clock":             {"inspect_reports_the_stored_record_its_version_and_the_backend_now"},
	"inspect does not validate its key":              {"operations_refuse_invalid_records_and_keys"},
	"inspect ignores a cancelled ctx":                {"operations_with_a_cancelled_context_fail_and_change_nothing"},
	"inspect reports the lease expiry as expires-at": {"inspect_reports_the_stored_record_its_version_and_the_backend_now"},

	// List.
	"list skips the first record after a page":  {"list_pages_hold_at_most_the_limit_and_reach_every_record_once", "list_reports_every_record_under_the_prefix_and_none_outside"},
	"list ends a full page without a cursor":    {"list_pages_hold_at_most_the_limit_and_reach_every_record_once", "list_refuses_a_cursor_from_another_listing"},
	"list returns a page above the limit":       {"list_pages_hold_at_most_the_limit_and_reach_every_record_once"},
	"list pages at most 100 whatever the limit": {"list_pages_hold_at_most_the_limit_and_reach_every_record_once"},
	"list ignores the state filter":             {"list_filters_by_state"},
	"list filters by the state of the lease":    {"list_filters_by_state"},
	"list ignores the last byte of the prefix":  {"list_reports_every_record_under_the_prefix_and_none_outside"},
	"list folds the case of the prefix":         {"list_reports_every_record_under_the_prefix_and_none_outside", "list_treats_the_prefix_as_bytes_not_a_pattern"},
	"list treats the prefix as a LIKE pattern":  {"list_treats_the_prefix_as_bytes_not_a_pattern"},
	"list ranges the prefix up to 0xff":         {"list_prefixes_match_bytes_beyond_utf8"},
	"list accepts a foreign cursor":             {"list_refuses_a_cursor_from_another_listing"},
	"list does not validate the query":          {"list_refuses_invalid_queries"},
	"list reports the raw token as version":     {"list_filters_by_state"},
	"list repeats the last record of a page":    {"list_pages_hold_at_most_the_limit_and_reach_every_record_once"},
	"list ignores a cancelled ctx":              {"operations_with_a_cancelled_context_fail_and_change_nothing"},

	// ForceRelease.
	"force-release keeps the fence":                             {"force_release_frees_a_live_claim_and_fences_out_its_holder", "force_release_frees_a_lapsed_claim"},
	"force-release keeps the lease":                             {"force_release_frees_a_live_claim_and_fences_out_its_holder"},
	"force-release deletes the record":                          {"force_release_frees_a_live_claim_and_fences_out_its_holder"},
	"force-release of a done record reopens it":                 {"force_release_of_a_done_record_is_false_and_changes_nothing"},
	"force-release ignores the version":                         {"force_release_of_a_stale_or_missing_record_is_false_and_changes_nothing"},
	"force-release ignores the fence":                           {"force_release_of_a_stale_or_missing_record_is_false_and_changes_nothing", "force_release_frees_a_live_claim_and_fences_out_its_holder"},
	"force-release answers true when nothing changed":           {"force_release_of_a_stale_or_missing_record_is_false_and_changes_nothing", "force_release_of_a_done_record_is_false_and_changes_nothing"},
	"force-release creates a missing record":                    {"force_release_of_a_stale_or_missing_record_is_false_and_changes_nothing"},
	"force-release requires a live lease":                       {"force_release_frees_a_lapsed_claim"},
	"force-release races between read and write":                {"racing_force_releases_or_forgets_of_one_record_admit_exactly_one"},
	"force-release does not validate the record":                {"operations_refuse_invalid_records_and_keys"},
	"force-release ignores a cancelled ctx":                     {"operations_with_a_cancelled_context_fail_and_change_nothing"},
	"a force-release retried after a lost reply releases again": {"a_force_release_or_forget_whose_reply_was_lost_is_safe_to_retry"},

	// Forget.
	"forget deletes a live claim":              {"forget_never_deletes_a_claimed_record"},
	"forget deletes a lapsed claim":            {"forget_never_deletes_a_claimed_record"},
	"forget trusts the state of the record":    {"forget_never_deletes_a_claimed_record"},
	"forget ignores the version":               {"forget_of_a_stale_or_missing_record_is_false_and_changes_nothing"},
	"forget ignores the fence":                 {"forget_of_a_stale_or_missing_record_is_false_and_changes_nothing"},
	"forget answers true when nothing changed": {"forget_of_a_stale_or_missing_record_is_false_and_changes_nothing", "forget_deletes_a_done_record_and_the_next_claim_starts_over_at_fence_1"},
	"forget spares an expired record":          {"forget_deletes_a_done_record_and_the_next_claim_starts_over_at_fence_1"},
	"forget resets the record to fence 0":      {"forget_deletes_a_done_record_and_the_next_claim_starts_over_at_fence_1"},
	"forget races between read and write":      {"racing_force_releases_or_forgets_of_one_record_admit_exactly_one"},
	"forget does not validate the record":      {"operations_refuse_invalid_records_and_keys"},
	"forget ignores a cancelled ctx":           {"operations_with_a_cancelled_context_fail_and_change_nothing"},
}

var _ store.Operator = (*mutant)(nil)

// opsRecord is the operator's view of r, with m.mu held.
func (m *mutant) opsRecord(key string, r *rec, now time.Time) store.Record {
	v := store.VersionOf(r.token)
	switch m.bug {
	case "inspect reports the raw token as version", "list reports the raw token as version":
		v = r.token
	case "inspect reports the version of the key":
		v = store.VersionOf(key)
	}
	exp := r.expiry
	if m.is("inspect reports the lease expiry as expires-at") {
		exp = r.lease
	}
	return store.Record{Key: key, State: r.state, Fence: r.fence, LeaseExpiry: r.lease, ExpiresAt: exp, Fingerprint: r.fp, Version: v, Now: now}
}

func (m *mutant) Inspect(ctx context.Context, key string) (store.Record, bool, error) {
	if err := m.validKey(key, m.is("inspect does not validate its key")); err != nil {
		return store.Record{}, false, err
	}
	if err := m.ctxErr(ctx, m.is("inspect ignores a cancelled ctx")); err != nil {
		return store.Record{}, false, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	r, ok := m.recs[key]
	if !ok {
		return store.Record{}, false, nil
	}
	reclaimable := r.state == store.Claimed && !now.Before(r.lease) || r.state == store.Done && !now.Before(r.expiry)
	switch {
	case m.is("inspect bumps the fence"):
		r.fence++
	case m.is("inspect deletes reclaimable records") && reclaimable:
		delete(m.recs, key)
		return store.Record{}, false, nil
	case m.is("inspect hides expired records") && !now.Before(r.expiry):
		return store.Record{}, false, nil
	}
	if m.is("inspect reports the client's clock") {
		now = now.Add(-time.Second)
	}
	rec := m.opsRecord(key, r, now)
	if m.is("inspect bumps the fence") {
		rec.Fence--
	}
	return rec, true, nil
}

const mutantCursor = "mutant."

func (m *mutant) List(ctx context.Context, q store.ListQuery) (store.Page, error) {
	if !m.is("list does not validate the query") {
		if err := store.ValidateQuery(q); err != nil {
			return store.Page{}, err
		}
	}
	from := ""
	if q.Cursor != "" {
		raw, err := base64.RawURLEncoding.DecodeString(strings.TrimPrefix(q.Cursor, mutantCursor))
		parts := strings.SplitN(string(raw), "\x00", 3)
		switch {
		case err != nil || !strings.HasPrefix(q.Cursor, mutantCursor) || len(parts) != 3:
			return store.Page{}, fmt.Errorf("%w: not a cursor", store.ErrInvalidQuery)
		case (parts[0] != q.Prefix || parts[1] != q.State.String()) && !m.is("list accepts a foreign cursor"):
			return store.Page{}, fmt.Errorf("%w: a foreign cursor", store.ErrInvalidQuery)
		}
		from = parts[2]
	}
	if err := m.ctxErr(ctx, m.is("list ignores a cancelled ctx")); err != nil {
		return store.Page{}, err
	}
	limit := q.Limit
	if limit <= 0 {
		limit = store.DefaultListLimit
	}
	switch m.bug {
	case "list returns a page above the limit":
		limit++
	case "list pages at most 100 whatever the limit":
		limit = store.DefaultListLimit
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	var keys []string
	for k, r := range m.recs {
		if k <= from || !m.underPrefix(k, q.Prefix) {
			continue
		}
		state := r.state
		if m.is("list filters by the state of the lease") && state == store.Claimed && !now.Before(r.lease) {
			state = store.Done
		}
		if q.State == 0 || state == q.State || m.is("list ignores the state filter") {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	var p store.Page
	for i, k := range keys {
		if i == limit {
			last := keys[i-1]
			switch m.bug {
			case "list skips the first record after a page":
				last = keys[i]
			case "list ends a full page without a cursor":
				return p, nil
			case "list repeats the last record of a page":
				if i > 1 {
					last = keys[i-2]
				}
			}
			p.Next = mutantCursor + base64.RawURLEncoding.EncodeToString([]byte(q.Prefix+"\x00"+q.State.String()+"\x00"+last))
			break
		}
		p.Records = append(p.Records, m.opsRecord(k, m.recs[k], now))
	}
	return p, nil
}

// like reports whether key starts with what the SQL LIKE pattern matches
// (% any bytes, _ one byte), the pattern being the prefix unescaped.
func like(key, pattern string) bool {
	if pattern == "" {
		return true
	}
	switch pattern[0] {
	case '%':
		for i := 0; i <= len(key); i++ {
			if like(key[i:], pattern[1:]) {
				return true
			}
		}
		return false
	case '_':
		return key != "" && like(key[1:], pattern[1:])
	}
	return key != "" && key[0] == pattern[0] && like(key[1:], pattern[1:])
}

// underPrefix reports whether key is under prefix, as the list bugs have it.
func (m *mutant) underPrefix(key, prefix string) bool {
	switch m.bug {
	case "list ignores the last byte of the prefix":
		return prefix == "" || strings.HasPrefix(key, prefix[:len(prefix)-1])
	case "list folds the case of the prefix":
		return strings.HasPrefix(strings.ToLower(key), strings.ToLower(prefix))
	case "list treats the prefix as a LIKE pattern":
		return like(key, prefix)
	case "list ranges the prefix up to 0xff":
		return key >= prefix && key < prefix+"\xff"
	}
	return strings.HasPrefix(key, prefix)
}

func (m *mutant) ForceRelease(ctx context.Context, r store.Record) (bool, error) {
	if !m.is("force-release does not validate the record") {
		if err := store.ValidateRecord(r); err != nil {
			return false, err
		}
	}
	if err := m.ctxErr(ctx, m.is("force-release ignores a cancelled ctx")); err != nil {
		return false, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	cur, ok := m.recs[r.Key]
	if !ok {
		if m.is("force-release creates a missing record") {
			m.recs[r.Key] = &rec{state: store.Claimed, fence: r.Fence + 1, lease: now, expiry: now.Add(m.keep())}
			return true, nil
		}
		return false, nil
	}
	match := (cur.state == store.Claimed || m.is("force-release of a done record reopens it")) &&
		(cur.fence == r.Fence || m.is("force-release ignores the fence")) &&
		(store.VersionOf(cur.token) == r.Version || m.is("force-release ignores the version")) &&
		(now.Before(cur.lease) || !m.is("force-release requires a live lease"))
	if m.is("force-release races between read and write") && match {
		m.mu.Unlock()
		time.Sleep(raceWindow)
		m.mu.Lock()
	}
	if !match {
		if m.is("force-release answers true when nothing changed") {
			return true, nil
		}
		return false, nil
	}
	switch {
	case m.is("force-release deletes the record"):
		delete(m.recs, r.Key)
	default:
		cur.state = store.Claimed
		if !m.is("force-release keeps the fence") {
			cur.fence++
		}
		if !m.is("force-release keeps the lease") {
			cur.lease = now
		}
		cur.expiry = cur.lease.Add(m.keep())
	}
	if m.replyLost() {
		if m.is("a force-release retried after a lost reply releases again") {
			// It retries, matching the version alone, and releases again.
			cur.fence++
			return true, nil
		}
		return false, fmt.Errorf("mutant: force-release: %w", errLost)
	}
	return true, nil
}

func (m *mutant) Forget(ctx context.Context, r store.Record) (bool, error) {
	if !m.is("forget does not validate the record") {
		if err := store.ValidateRecord(r); err != nil {
			return false, err
		}
	}
	if err := m.ctxErr(ctx, m.is("forget ignores a cancelled ctx")); err != nil {
		return false, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	cur, ok := m.recs[r.Key]
	if !ok {
		return m.is("forget answers true when nothing changed"), nil
	}
	state := cur.state
	switch {
	case m.is("forget trusts the state of the record"):
		state = r.State
	case m.is("forget deletes a live claim") && now.Before(cur.lease):
		state = store.Done
	case m.is("forget deletes a lapsed claim") && !now.Before(cur.lease):
		state = store.Done
	}
	match := state == store.Done &&
		(cur.fence == r.Fence || m.is("forget ignores the fence")) &&
		(store.VersionOf(cur.token) == r.Version || m.is("forget ignores the version")) &&
		(now.Before(cur.expiry) || !m.is("forget spares an expired record"))
	if m.is("forget races between read and write") && match {
		m.mu.Unlock()
		time.Sleep(raceWindow)
		m.mu.Lock()
	}
	if !match {
		return m.is("forget answers true when nothing changed"), nil
	}
	if m.is("forget resets the record to fence 0") {
		cur.state, cur.fence, cur.lease, cur.expiry = store.Claimed, 0, now, now
	} else {
		delete(m.recs, r.Key)
	}
	if m.replyLost() {
		return false, fmt.Errorf("mutant: forget: %w", errLost)
	}
	return true, nil
}

// TestOpsMutant runs RunOps on the mutant that STORETEST_OPS_MUTANT names.
// It does nothing unless TestSuiteCatchesOpsMutants starts it.
func TestOpsMutant(t *testing.T) {
	bug, ok := os.LookupEnv("STORETEST_OPS_MUTANT")
	if !ok {
		t.Skip("run by TestSuiteCatchesOpsMutants, one process per mutant")
	}
	if _, known := opsMutants[bug]; !known && bug != "" {
		t.Fatalf("unknown ops mutant %q", bug)
	}
	storetest.RunOps(t, func(t *testing.T) storetest.Harness {
		clock := fake.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
		m := &mutant{bug: bug, clock: clock, ttl: time.Hour, recs: map[string]*rec{}}
		return storetest.Harness{Backend: m, TTL: m.ttl, Advance: clock.Advance, Now: clock.Now, Faults: m}
	})
}

// TestSuiteCatchesOpsMutants runs RunOps on every ops mutant, each in a
// process of its own: every mutant must fail the cases named after the
// rule it breaks, and the mutant with no bug must fail none.
func TestSuiteCatchesOpsMutants(t *testing.T) {
	if os.Getenv("STORETEST_OPS_MUTANT") != "" {
		t.Skip("inside a mutant run")
	}
	killed := runMutants(t, "TestOpsMutant", "STORETEST_OPS_MUTANT", opsMutants, 20)
	t.Logf("ops mutants killed: %d of %d", killed, len(opsMutants))
}

// raceWindow is how long the racing mutants hold a decision they read
// before they write it: wide enough that, under -race on a loaded 2-core
// machine, the other racers of the case reach the same read meanwhile (at
// 1ms the forget mutant survived a run).
const raceWindow = 20 * time.Millisecond
