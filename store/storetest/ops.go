package storetest

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// opsEnv is the env of a RunOps case, with the backend as a store.Operator.
type opsEnv struct {
	*env
	op store.Operator
}

type opsRule struct {
	name string
	run  func(t *testing.T, e *opsEnv)
}

// opsRules lists every RunOps case. The names read as "a backend should ...".
var opsRules = []opsRule{
	{"inspect_reports_the_stored_record_its_version_and_the_backend_now", opsInspect},
	{"inspect_of_a_missing_key_reports_no_record", opsInspectMissing},
	{"inspect_reports_lapsed_and_expired_records_as_stored", opsInspectLapsed},
	{"inspect_and_list_change_nothing", opsReadOnly},
	{"list_reports_every_record_under_the_prefix_and_none_outside", opsListPrefix},
	{"list_treats_the_prefix_as_bytes_not_a_pattern", opsListPattern},
	{"list_prefixes_match_bytes_beyond_utf8", opsListBytes},
	{"list_filters_by_state", opsListState},
	{"list_pages_hold_at_most_the_limit_and_reach_every_record_once", opsListPages},
	{"list_refuses_invalid_queries", opsListInvalid},
	{"list_refuses_a_cursor_from_another_listing", opsListForeignCursor},
	{"force_release_frees_a_live_claim_and_fences_out_its_holder", opsForceLive},
	{"force_release_frees_a_lapsed_claim", opsForceLapsed},
	{"force_release_of_a_done_record_is_false_and_changes_nothing", opsForceDone},
	{"force_release_of_a_stale_or_missing_record_is_false_and_changes_nothing", opsForceStale},
	{"forget_deletes_a_done_record_and_the_next_claim_starts_over_at_fence_1", opsForget},
	{"forget_never_deletes_a_claimed_record", opsForgetClaimed},
	{"forget_of_a_stale_or_missing_record_is_false_and_changes_nothing", opsForgetStale},
	{"operations_refuse_invalid_records_and_keys", opsInvalid},
	{"operations_with_a_cancelled_context_fail_and_change_nothing", opsCancelled},
	{"racing_force_releases_or_forgets_of_one_record_admit_exactly_one", opsRace},
	{"a_force_release_or_forget_whose_reply_was_lost_is_safe_to_retry", opsLost},
}

// RunOps runs every case about the operations interfaces
// ([store.Operator]: Inspect, List, ForceRelease, Forget) as a subtest of
// t, each named after the rule it checks and selectable with -run:
//
//	go test -run 'TestOps/force_release' ./mybackend
//
// newHarness is called once per case, with the subtest's *testing.T, as
// for [Run]; cases run in parallel, each with keys (and list prefixes) of
// its own, so they may share a store. Every case fails, rather than skips,
// when the Harness's Backend does not implement store.Operator. The case
// about lost replies is skipped without [Harness].Faults; set
// [Harness].ListMayRepeat for a backend whose List may report a record
// twice.
func RunOps(t *testing.T, newHarness func(t *testing.T) Harness) {
	t.Helper()
	for _, r := range opsRules {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			if strings.HasPrefix(r.name, "list_") && h.WithTTL != nil {
				// A listing of a hundred records can take seconds on a
				// loaded machine: the done records must outlive it, or a
				// store that expires records itself (Redis) drops them
				// mid-listing and the case fails for no fault of List.
				long := max(h.TTL, time.Hour)
				h.Backend, h.TTL = h.WithTTL(long), long
			}
			op, ok := h.Backend.(store.Operator)
			if !ok {
				t.Fatalf("storetest: %T does not implement store.Operator (Inspect, List, ForceRelease, Forget)", h.Backend)
			}
			r.run(t, &opsEnv{env: newEnv(t, h), op: op})
		})
	}
}

// inspect reads key's record, checking that Now lies within the call.
func (e *opsEnv) inspect(key string) (store.Record, bool) {
	e.t.Helper()
	before := e.h.Now()
	r, ok, err := e.op.Inspect(e.ctx, key)
	after := e.h.Now()
	if err != nil {
		e.t.Fatalf("Inspect(%q): %v", key, err)
	}
	if !ok {
		if r != (store.Record{}) {
			e.t.Fatalf("Inspect(%q) = %+v, false: a missing record must be the zero Record", key, r)
		}
		return r, false
	}
	if r.Key != key {
		e.t.Fatalf("Inspect(%q): Record.Key = %q", key, r.Key)
	}
	e.checkRecord("Inspect", r, before, after)
	return r, true
}

// checkRecord checks what holds of every record a read returns.
func (e *opsEnv) checkRecord(call string, r store.Record, before, after time.Time) {
	e.t.Helper()
	if r.State != store.Claimed && r.State != store.Done {
		e.t.Fatalf("%s(%q): state %v, want claimed or done", call, r.Key, r.State)
	}
	if r.Fence < 1 {
		e.t.Fatalf("%s(%q): fence %d, want at least 1", call, r.Key, r.Fence)
	}
	if len(r.Version) != 16 || strings.Trim(r.Version, "0123456789abcdef") != "" {
		e.t.Fatalf("%s(%q): Version %q is not store.VersionOf of a token (16 hex digits)", call, r.Key, r.Version)
	}
	e.within(call+"("+r.Key+").Now", r.Now, before, after)
}

// mustInspect reads key's record, which must exist.
func (e *opsEnv) mustInspect(key string) store.Record {
	e.t.Helper()
	r, ok := e.inspect(key)
	if !ok {
		e.t.Fatalf("Inspect(%q): no record, want one", key)
	}
	return r
}

// wantMissing fails the case if key has a record.
func (e *opsEnv) wantMissing(key, why string) {
	e.t.Helper()
	if r, ok := e.inspect(key); ok {
		e.t.Fatalf("%s: Inspect(%q) = %+v, want no record", why, key, r)
	}
}

// sameRecord reports how a and b, two reads of one record, differ in what
// the record holds (Now aside; a Done record's lease expiry aside, which
// the port lets a backend not keep), or "" when they do not.
func sameRecord(a, b store.Record) string {
	var d []string
	if a.Key != b.Key {
		d = append(d, fmt.Sprintf("key %q != %q", a.Key, b.Key))
	}
	if a.State != b.State {
		d = append(d, fmt.Sprintf("state %v != %v", a.State, b.State))
	}
	if a.Fence != b.Fence {
		d = append(d, fmt.Sprintf("fence %d != %d", a.Fence, b.Fence))
	}
	if a.Version != b.Version {
		d = append(d, fmt.Sprintf("version %q != %q", a.Version, b.Version))
	}
	if a.Fingerprint != b.Fingerprint {
		d = append(d, fmt.Sprintf("fingerprint %q != %q", a.Fingerprint, b.Fingerprint))
	}
	if !sameInstant(a.ExpiresAt, b.ExpiresAt) {
		d = append(d, fmt.Sprintf("expires-at %v != %v", a.ExpiresAt, b.ExpiresAt))
	}
	if a.State == store.Claimed && b.State == store.Claimed && !sameInstant(a.LeaseExpiry, b.LeaseExpiry) {
		d = append(d, fmt.Sprintf("lease expiry %v != %v", a.LeaseExpiry, b.LeaseExpiry))
	}
	return strings.Join(d, ", ")
}

// unchanged fails the case unless key's record is still was.
func (e *opsEnv) unchanged(was store.Record, why string) {
	e.t.Helper()
	now, ok := e.inspect(was.Key)
	if !ok {
		e.t.Fatalf("%s: the record of %q is gone; want it unchanged (%+v)", why, was.Key, was)
	}
	if d := sameRecord(was, now); d != "" {
		e.t.Fatalf("%s: the record of %q changed: %s", why, was.Key, d)
	}
}

func (e *opsEnv) forceRelease(r store.Record, want bool) {
	e.t.Helper()
	ok, err := e.op.ForceRelease(e.ctx, r)
	if err != nil {
		e.t.Fatalf("ForceRelease(%q, fence %d, version %q): %v", r.Key, r.Fence, r.Version, err)
	}
	if ok != want {
		e.t.Fatalf("ForceRelease(%q, fence %d, version %q) = %v, want %v", r.Key, r.Fence, r.Version, ok, want)
	}
}

func (e *opsEnv) forget(r store.Record, want bool) {
	e.t.Helper()
	ok, err := e.op.Forget(e.ctx, r)
	if err != nil {
		e.t.Fatalf("Forget(%q, fence %d, version %q): %v", r.Key, r.Fence, r.Version, err)
	}
	if ok != want {
		e.t.Fatalf("Forget(%q, fence %d, version %q) = %v, want %v", r.Key, r.Fence, r.Version, ok, want)
	}
}

// extendLost checks, on a backend with Extend, that c can no longer renew.
func (e *opsEnv) extendLost(c store.Claim, why string) {
	e.t.Helper()
	if x, ok := e.h.Backend.(store.Extender); ok {
		if _, err := x.Extend(e.ctx, c, e.long()); !errors.Is(err, store.ErrLost) {
			e.t.Fatalf("%s: Extend(%q, fence %d): err = %v, want ErrLost", why, c.Key, c.Fence, err)
		}
	}
}

// maxPages bounds a listing, so that a cursor that never ends fails.
const maxPages = 20000

// list follows q's listing to its end and returns the records it reported
// by key. It checks every page: at most the limit, every record under the
// prefix and, when q.State is set, in that state, each a valid record read
// within the call; and each record once unless Harness.ListMayRepeat.
func (e *opsEnv) list(q store.ListQuery) map[string]store.Record {
	e.t.Helper()
	limit := q.Limit
	if limit == 0 {
		limit = store.DefaultListLimit
	}
	seen := map[string]store.Record{}
	for pages := 0; ; pages++ {
		if pages == maxPages {
			e.t.Fatalf("List(prefix %q, state %v, limit %d): no end after %d pages (%d records)", q.Prefix, q.State, q.Limit, maxPages, len(seen))
		}
		before := e.h.Now()
		p, err := e.op.List(e.ctx, q)
		after := e.h.Now()
		if err != nil {
			e.t.Fatalf("List(prefix %q, state %v, limit %d, page %d): %v", q.Prefix, q.State, q.Limit, pages+1, err)
		}
		if len(p.Records) > limit {
			e.t.Fatalf("List(prefix %q, limit %d): a page of %d records, above the limit %d", q.Prefix, q.Limit, len(p.Records), limit)
		}
		for _, r := range p.Records {
			if !strings.HasPrefix(r.Key, q.Prefix) {
				e.t.Fatalf("List(prefix %q): reported %q, outside the prefix", q.Prefix, r.Key)
			}
			if q.State != 0 && r.State != q.State {
				e.t.Fatalf("List(prefix %q, state %v): reported %q in state %v", q.Prefix, q.State, r.Key, r.State)
			}
			e.checkRecord("List", r, before, after)
			if _, dup := seen[r.Key]; dup && !e.h.ListMayRepeat {
				e.t.Fatalf("List(prefix %q, state %v, limit %d): reported %q twice (Harness.ListMayRepeat is false)", q.Prefix, q.State, q.Limit, r.Key)
			}
			seen[r.Key] = r
		}
		if p.Next == "" {
			return seen
		}
		q.Cursor = p.Next
	}
}

// wantKeys fails the case unless got holds exactly the keys want.
func (e *opsEnv) wantKeys(what string, got map[string]store.Record, want []string) {
	e.t.Helper()
	var missing, extra []string
	w := map[string]bool{}
	for _, k := range want {
		w[k] = true
		if _, ok := got[k]; !ok {
			missing = append(missing, k)
		}
	}
	for k := range got {
		if !w[k] {
			extra = append(extra, k)
		}
	}
	sort.Strings(missing)
	sort.Strings(extra)
	if len(missing) > 0 || len(extra) > 0 {
		e.t.Fatalf("%s: missing %q, unexpected %q", what, missing, extra)
	}
}

// lapsed returns a claim of a new key whose lease has lapsed.
func (e *opsEnv) lapsed() store.Claim {
	e.t.Helper()
	c := e.won(e.key(), e.short())
	e.pass(e.short())
	return c
}

// doneKey returns a claim of a new key, completed.
func (e *opsEnv) doneKey() store.Claim {
	e.t.Helper()
	c := e.won(e.key(), e.long())
	e.complete(c, true)
	return c
}

func opsInspect(t *testing.T, e *opsEnv) {
	k := e.key()
	c := e.won(k, e.long())
	r := e.mustInspect(k)
	if r.State != store.Claimed || r.Fence != c.Fence {
		t.Fatalf("Inspect of a live claim: state %v fence %d, want claimed fence %d", r.State, r.Fence, c.Fence)
	}
	if r.Version != store.VersionOf(c.Token) {
		t.Fatalf("Inspect: Version = %q, want store.VersionOf(the claim's token) = %q", r.Version, store.VersionOf(c.Token))
	}
	if !sameInstant(r.LeaseExpiry, c.LeaseExpiry) {
		t.Fatalf("Inspect: LeaseExpiry = %v, want the claim's %v", r.LeaseExpiry, c.LeaseExpiry)
	}
	// A claimed record outlives its lease by the ttl.
	if r.ExpiresAt.Before(c.LeaseExpiry.Add(e.h.TTL).Add(-tolerance)) {
		t.Fatalf("Inspect: ExpiresAt = %v, before the lease expiry plus the ttl %v", r.ExpiresAt, c.LeaseExpiry.Add(e.h.TTL))
	}
	if r.Fingerprint != "" {
		t.Fatalf("Inspect of a claim: Fingerprint = %q, want none", r.Fingerprint)
	}
	if r.Reclaimable() {
		t.Fatalf("Inspect of a live claim: Reclaimable at %v with lease expiry %v", r.Now, r.LeaseExpiry)
	}

	e.pass(e.short())
	fp := ""
	before := e.h.Now()
	if f, ok := e.h.Backend.(store.Fingerprinter); ok {
		fp = "sha256:ops-inspect"
		e.completeFP(f, c, fp, true)
	} else {
		e.complete(c, true)
	}
	after := e.h.Now()
	d := e.mustInspect(k)
	if d.State != store.Done || d.Fence != c.Fence || d.Version != store.VersionOf(c.Token) || d.Fingerprint != fp {
		t.Fatalf("Inspect of a done key = %+v; want done, fence %d, version %q, fingerprint %q", d, c.Fence, store.VersionOf(c.Token), fp)
	}
	// Suppression ends at completion + ttl.
	e.within("Inspect of a done key: ExpiresAt", d.ExpiresAt, before.Add(e.h.TTL), after.Add(e.h.TTL))
	if d.Reclaimable() {
		t.Fatalf("Inspect of a key done within its ttl: Reclaimable at %v with expires-at %v", d.Now, d.ExpiresAt)
	}
}

func opsInspectMissing(t *testing.T, e *opsEnv) {
	k := e.key()
	e.wantMissing(k, "a key never claimed")
	// A key that shares all but its last byte with a record is another key.
	e.won(k+"x", e.long())
	e.wantMissing(k, "a key next to a record")
	e.wantMissing(k+"xx", "a key next to a record")
}

func opsInspectLapsed(t *testing.T, e *opsEnv) {
	c := e.lapsed()
	r := e.mustInspect(c.Key)
	if r.State != store.Claimed || r.Fence != c.Fence || r.Version != store.VersionOf(c.Token) || !sameInstant(r.LeaseExpiry, c.LeaseExpiry) {
		t.Fatalf("Inspect of a lapsed claim = %+v; want it as stored: claimed, fence %d, lease expiry %v", r, c.Fence, c.LeaseExpiry)
	}
	if !r.Reclaimable() {
		t.Fatalf("Inspect of a lapsed claim: not Reclaimable at %v with lease expiry %v", r.Now, r.LeaseExpiry)
	}
	claimed := e.list(store.ListQuery{Prefix: c.Key, State: store.Claimed})
	e.wantKeys("List of a lapsed claim", claimed, []string{c.Key})

	d := e.doneKey()
	e.pass(e.h.TTL)
	r, ok := e.inspect(d.Key)
	if !ok {
		// A clock the suite moves is one the store cannot reap by: the
		// record is there, and Inspect must report it.
		if e.h.Advance != nil {
			t.Fatalf("Inspect of a done key past its ttl: no record; an expired record must be reported as stored until something deletes it")
		}
		t.Logf("the expired record of %q was reaped by its store", d.Key)
		return
	}
	if r.State != store.Done || r.Fence != d.Fence || r.Version != store.VersionOf(d.Token) || !r.Reclaimable() {
		t.Fatalf("Inspect of a done key past its ttl = %+v (reclaimable %v); want done, fence %d, reclaimable", r, r.Reclaimable(), d.Fence)
	}
	if e.h.Advance != nil {
		done := e.list(store.ListQuery{Prefix: d.Key, State: store.Done})
		e.wantKeys("List of a done key past its ttl", done, []string{d.Key})
	}
}

func opsReadOnly(t *testing.T, e *opsEnv) {
	p := e.key() + "/"
	expired := e.won(p+"expired", e.long())
	e.complete(expired, true)
	e.pass(e.h.TTL)
	live := e.won(p+"live", e.long())
	lapsed := e.won(p+"lapsed", e.short())
	done := e.won(p+"done", e.long())
	e.complete(done, true)
	e.pass(e.short())

	first := map[string]store.Record{}
	for _, k := range []string{live.Key, lapsed.Key, done.Key} {
		first[k] = e.mustInspect(k)
	}
	for range 3 {
		for _, k := range []string{live.Key, lapsed.Key, expired.Key, done.Key, p + "missing"} {
			e.inspect(k)
		}
		e.list(store.ListQuery{Prefix: p})
		e.list(store.ListQuery{Prefix: p, Limit: 1})
		e.list(store.ListQuery{Prefix: p, State: store.Claimed})
		e.list(store.ListQuery{Prefix: p, State: store.Done})
	}
	for _, r := range first {
		e.unchanged(r, "after reads")
	}
	e.wantMissing(p+"missing", "after reads of a missing key")
	// The live claim still holds; the lapsed one is reclaimed with the next
	// fence, not a fence that reads raised nor a fresh record's.
	e.expect(live.Key, store.HeldByOther)
	e.complete(live, true)
	next := e.won(lapsed.Key, e.long())
	if next.Fence != lapsed.Fence+1 {
		t.Fatalf("reclaim of a lapsed claim after reads: fence %d, want %d", next.Fence, lapsed.Fence+1)
	}
	e.complete(lapsed, false)
	e.expect(done.Key, store.AlreadyDone)
	again := e.won(expired.Key, e.long())
	switch {
	case again.Fence == expired.Fence+1:
	case again.Fence == 1 && e.h.Advance == nil:
		t.Logf("the expired record of %q was reaped by its store", expired.Key)
	default:
		t.Fatalf("claim of an expired done key after reads: fence %d, want %d (reads must not delete it)", again.Fence, expired.Fence+1)
	}
}

// under returns the keys of keys that start with prefix.
func under(keys []string, prefix string) []string {
	var in []string
	for _, k := range keys {
		if strings.HasPrefix(k, prefix) {
			in = append(in, k)
		}
	}
	return in
}

// claimAll claims every key of keys, completing every other one, and
// returns keys without duplicates.
func (e *opsEnv) claimAll(keys []string) []string {
	e.t.Helper()
	seen := map[string]bool{}
	var out []string
	for _, k := range keys {
		if seen[k] {
			continue
		}
		seen[k] = true
		c := e.won(k, e.long())
		if len(out)%2 == 1 {
			e.complete(c, true)
		}
		out = append(out, k)
	}
	return out
}

// wantPrefix lists prefix, whole and one record a page, and fails the
// case unless it reports exactly the keys of all under prefix.
func (e *opsEnv) wantPrefix(all []string, prefix string) {
	e.t.Helper()
	want := under(all, prefix)
	e.wantKeys(fmt.Sprintf("List(prefix %q)", prefix), e.list(store.ListQuery{Prefix: prefix}), want)
	e.wantKeys(fmt.Sprintf("List(prefix %q, limit 1)", prefix), e.list(store.ListQuery{Prefix: prefix, Limit: 1}), want)
}

func opsListPrefix(t *testing.T, e *opsEnv) {
	base := e.key() + "/"
	p := base + "grp"
	inside := []string{p, p + "/a", p + "/a/b", p + "a", p + "~", p + "grp"}
	outside := []string{base + "gr", base + "grq", base + "gro", base + "gro~", base + "GRP", base + "grP/a", base + "g", base + "hrp"}
	all := e.claimAll(append(append([]string{}, inside...), outside...))
	if got := under(all, p); len(got) != len(inside) {
		t.Fatalf("storetest: %d keys under %q, want %d", len(got), p, len(inside))
	}
	e.wantPrefix(all, p)
	e.wantPrefix(all, base)
	e.wantPrefix(all, base+"gr")
	// A prefix that is a whole key lists that key and the keys it starts.
	e.wantPrefix(all, p+"/a")
	e.wantPrefix(all, p+"/none")
	e.wantKeys("List(prefix of the case, limit 3)", e.list(store.ListQuery{Prefix: base, Limit: 3}), all)
	// Every listed record is as Inspect reports it.
	for k, r := range e.list(store.ListQuery{Prefix: base}) {
		if d := sameRecord(r, e.mustInspect(k)); d != "" {
			t.Fatalf("List and Inspect of %q differ: %s", k, d)
		}
	}
}

func opsListPattern(t *testing.T, e *opsEnv) {
	base := e.key() + "/"
	// Wildcards of SQL LIKE, Redis MATCH, regular expressions and globs.
	p := base + `50%_off*?[a-c]\x.^$+(|){}`
	keys := []string{p, p + "%", p + "/b", base + "50", base + strings.ToUpper(p[len(base):]),
		base + "50%_off*?b" + p[len(base)+len("50%_off*?[a-c]"):]}
	for i := len(base); i < len(p); i++ {
		if strings.IndexByte(`%_*?[]\.^$+(|){}-`, p[i]) >= 0 {
			keys = append(keys, p[:i]+"Z"+p[i+1:], p[:i]+p[i+1:])
		}
	}
	all := e.claimAll(keys)
	if got := under(all, p); len(got) != 3 {
		t.Fatalf("storetest: %d keys under %q, want 3", len(got), p)
	}
	e.wantPrefix(all, p)
	e.wantPrefix(all, base+"50%")
	e.wantPrefix(all, base+"50_")
	e.wantPrefix(all, base+"50%_off*?[")
	e.wantPrefix(all, base+"50%_off*?[a-c]\\")
}

func opsListBytes(t *testing.T, e *opsEnv) {
	base := e.key() + "/"
	keys := []string{
		base + "\xc3", base + "\xc3\xa9", base + "\xc3\xff", base + "\xc3\x80\x80", base + "\xc3\x01",
		base + "\xc2\xff", base + "\xc4", base + "c", base + "\xff", base + "\xff\xff\xff", base + "\xfe\xff",
	}
	all := e.claimAll(keys)
	e.wantPrefix(all, base+"\xc3")
	e.wantPrefix(all, base+"\xc3\x80")
	e.wantPrefix(all, base+"\xc2")
	e.wantPrefix(all, base+"\xff")
	e.wantPrefix(all, base+"\xff\xff")
}

func opsListState(t *testing.T, e *opsEnv) {
	p := e.key() + "/"
	live := e.won(p+"live", e.long())
	lapsed := e.won(p+"lapsed", e.short())
	released := e.won(p+"released", e.long())
	e.release(released)
	done := e.won(p+"done", e.long())
	e.complete(done, true)
	e.pass(e.short())
	claimed := []string{live.Key, lapsed.Key, released.Key}
	e.wantKeys("List(state claimed)", e.list(store.ListQuery{Prefix: p, State: store.Claimed}), claimed)
	e.wantKeys("List(state claimed, limit 1)", e.list(store.ListQuery{Prefix: p, State: store.Claimed, Limit: 1}), claimed)
	e.wantKeys("List(state done)", e.list(store.ListQuery{Prefix: p, State: store.Done}), []string{done.Key})
	e.wantKeys("List(state done, limit 1)", e.list(store.ListQuery{Prefix: p, State: store.Done, Limit: 1}), []string{done.Key})
	all := e.list(store.ListQuery{Prefix: p})
	e.wantKeys("List(any state)", all, append(claimed, done.Key))
	for k, r := range all {
		if d := sameRecord(r, e.mustInspect(k)); d != "" {
			t.Fatalf("List and Inspect of %q differ: %s", k, d)
		}
	}
	if r := all[released.Key]; r.Fence != released.Fence+1 || !r.Reclaimable() {
		t.Fatalf("List of a released claim: fence %d reclaimable %v; want fence %d, reclaimable", r.Fence, r.Reclaimable(), released.Fence+1)
	}
	if r := all[done.Key]; r.Version != store.VersionOf(done.Token) {
		t.Fatalf("List: Version = %q, want store.VersionOf(the claim's token) = %q", r.Version, store.VersionOf(done.Token))
	}
}

func opsListPages(t *testing.T, e *opsEnv) {
	p := e.key() + "/"
	const n = 41
	var all, done []string
	for i := range n {
		c := e.won(fmt.Sprintf("%sk%03d", p, i*7%n), e.long())
		all = append(all, c.Key)
		if i%3 == 0 {
			e.complete(c, true)
			done = append(done, c.Key)
		}
	}
	for _, limit := range []int{1, 2, 3, 7, n - 1, n, n + 1, 0, store.MaxListLimit} {
		what := fmt.Sprintf("List(limit %d)", limit)
		e.wantKeys(what, e.list(store.ListQuery{Prefix: p, Limit: limit}), all)
	}
	for _, limit := range []int{1, 2, len(done)} {
		what := fmt.Sprintf("List(state done, limit %d)", limit)
		e.wantKeys(what, e.list(store.ListQuery{Prefix: p, State: store.Done, Limit: limit}), done)
	}
	// Past DefaultListLimit records, a zero limit pages at the default.
	for i := n; i <= store.DefaultListLimit+1; i++ {
		all = append(all, e.won(fmt.Sprintf("%sk%03d", p, i), e.long()).Key)
	}
	e.wantKeys("List(limit 0) of more than DefaultListLimit records", e.list(store.ListQuery{Prefix: p}), all)
	// The first page of the whole store holds no more than the limit.
	if pg, err := e.op.List(e.ctx, store.ListQuery{Limit: 2}); err != nil || len(pg.Records) > 2 {
		t.Fatalf("List(every key, limit 2) = %d records, %v; want at most 2, nil", len(pg.Records), err)
	}
}

func opsListInvalid(t *testing.T, e *opsEnv) {
	p := e.key()
	e.won(p, e.long())
	bad := []store.ListQuery{
		{Prefix: p, Limit: -1},
		{Prefix: p, Limit: store.MaxListLimit + 1},
		{Prefix: strings.Repeat("x", store.MaxKeyLen+1)},
		{Prefix: p + "\x00"},
		{Prefix: p, State: store.State(99)},
		{Prefix: p, Cursor: "\x00not a cursor\xff"},
	}
	for _, q := range bad {
		pg, err := e.op.List(e.ctx, q)
		if !errors.Is(err, store.ErrInvalidQuery) {
			t.Errorf("List(prefix %.20q, state %v, limit %d, cursor %q) = %d records, %v; want ErrInvalidQuery", q.Prefix, q.State, q.Limit, q.Cursor, len(pg.Records), err)
		}
	}
	// The limits themselves are valid.
	e.wantKeys("List(limit MaxListLimit)", e.list(store.ListQuery{Prefix: p, Limit: store.MaxListLimit}), []string{p})
	long := p + "/" + strings.Repeat("x", store.MaxKeyLen-len(p)-1)
	e.won(long, e.long())
	e.wantKeys("List(prefix of MaxKeyLen bytes)", e.list(store.ListQuery{Prefix: long}), []string{long})
}

func opsListForeignCursor(t *testing.T, e *opsEnv) {
	p := e.key() + "/"
	for i := range 5 {
		c := e.won(fmt.Sprintf("%s%d", p, i), e.long())
		if i%2 == 0 {
			e.complete(c, true)
		}
	}
	pg, err := e.op.List(e.ctx, store.ListQuery{Prefix: p, Limit: 1})
	if err != nil {
		t.Fatalf("List(limit 1): %v", err)
	}
	if pg.Next == "" {
		t.Fatalf("List(limit 1) of 5 records: %d records and no Next; the listing must reach all 5", len(pg.Records))
	}
	foreign := []store.ListQuery{
		{Prefix: p + "0", Cursor: pg.Next},
		{Prefix: p[:len(p)-1], Cursor: pg.Next},
		{Prefix: "", Cursor: pg.Next},
		{Prefix: p, State: store.Done, Cursor: pg.Next},
		{Prefix: p, State: store.Claimed, Cursor: pg.Next},
	}
	for _, q := range foreign {
		if _, err := e.op.List(e.ctx, q); !errors.Is(err, store.ErrInvalidQuery) {
			t.Errorf("List(prefix %q, state %v) with the cursor of List(prefix %q): err = %v, want ErrInvalidQuery", q.Prefix, q.State, p, err)
		}
	}
	// The cursor continues its own listing, whatever the limit.
	if _, err := e.op.List(e.ctx, store.ListQuery{Prefix: p, Cursor: pg.Next, Limit: 3}); err != nil {
		t.Fatalf("List with its own cursor and another limit: %v", err)
	}
}

func opsForceLive(t *testing.T, e *opsEnv) {
	k := e.key()
	c := e.won(k, e.long())
	r := e.mustInspect(k)
	before := e.h.Now()
	e.forceRelease(r, true)
	after := e.h.Now()
	rel := e.mustInspect(k)
	if rel.State != store.Claimed || rel.Fence != r.Fence+1 || rel.Version != r.Version {
		t.Fatalf("after ForceRelease: %+v; want claimed, fence %d, version %q (as Release leaves it)", rel, r.Fence+1, r.Version)
	}
	e.within("LeaseExpiry after ForceRelease", rel.LeaseExpiry, before, after)
	if !rel.Reclaimable() {
		t.Fatalf("after ForceRelease: not Reclaimable at %v, lease expiry %v", rel.Now, rel.LeaseExpiry)
	}
	// The old holder is fenced out at once.
	e.complete(c, false)
	e.extendLost(c, "after ForceRelease")
	e.release(c)
	e.unchanged(rel, "a Release by the released holder")
	// Retrying with the record as first read finds it changed.
	e.forceRelease(r, false)
	next := e.won(k, e.long())
	if next.Fence != c.Fence+2 {
		t.Fatalf("claim after ForceRelease: fence %d, want %d (force-release +1, reclaim +1)", next.Fence, c.Fence+2)
	}
	e.complete(c, false)
	e.release(c)
	e.extendLost(c, "after ForceRelease and a new claim")
	e.expect(k, store.HeldByOther)
	e.complete(next, true)
	e.expect(k, store.AlreadyDone)
}

func opsForceLapsed(t *testing.T, e *opsEnv) {
	c := e.lapsed()
	r := e.mustInspect(c.Key)
	e.forceRelease(r, true)
	if rel := e.mustInspect(c.Key); rel.State != store.Claimed || rel.Fence != r.Fence+1 || !rel.Reclaimable() {
		t.Fatalf("after ForceRelease of a lapsed claim: %+v; want claimed, fence %d, reclaimable", rel, r.Fence+1)
	}
	e.complete(c, false)
	next := e.won(c.Key, e.long())
	if next.Fence != c.Fence+2 {
		t.Fatalf("claim after ForceRelease of a lapsed claim: fence %d, want %d", next.Fence, c.Fence+2)
	}
	e.complete(c, false)
	e.complete(next, true)
}

func opsForceDone(t *testing.T, e *opsEnv) {
	c := e.doneKey()
	r := e.mustInspect(c.Key)
	e.forceRelease(r, false)
	forged := r
	forged.State = store.Claimed
	e.forceRelease(forged, false)
	e.unchanged(r, "ForceRelease of a done record")
	e.expect(c.Key, store.AlreadyDone)
	e.complete(c, true)
}

func opsForceStale(t *testing.T, e *opsEnv) {
	// Another fence: the lease lapsed and someone reclaimed.
	old := e.lapsed()
	r := e.mustInspect(old.Key)
	cur := e.won(old.Key, e.long())
	now := e.mustInspect(old.Key)
	e.forceRelease(r, false)
	e.unchanged(now, "ForceRelease with a stale fence")

	// The fence and version read, one of them altered.
	wrong := now
	wrong.Version = store.VersionOf("not the token of " + cur.Token)
	e.forceRelease(wrong, false)
	wrong = now
	wrong.Fence++
	e.forceRelease(wrong, false)
	wrong.Fence = now.Fence - 1
	e.forceRelease(wrong, false)
	e.unchanged(now, "ForceRelease with another fence or version")
	e.expect(cur.Key, store.HeldByOther)
	e.complete(cur, true)

	// Another version at the same fence: the record was forgotten and a new
	// claim started it over at fence 1 with a new token.
	first := e.doneKey()
	gone := e.mustInspect(first.Key)
	e.forget(gone, true)
	again := e.won(first.Key, e.long())
	if again.Fence != gone.Fence {
		t.Fatalf("claim after Forget: fence %d, want %d", again.Fence, gone.Fence)
	}
	fresh := e.mustInspect(first.Key)
	gone.State = store.Claimed
	e.forceRelease(gone, false)
	e.unchanged(fresh, "ForceRelease of a record re-created since it was read")
	e.expect(again.Key, store.HeldByOther)
	e.complete(again, true)

	// No record at all: nothing is created.
	missing := store.Record{Key: e.key(), State: store.Claimed, Fence: 1, Version: store.VersionOf("nobody")}
	e.forceRelease(missing, false)
	e.wantMissing(missing.Key, "ForceRelease of a missing record")
}

func opsForget(t *testing.T, e *opsEnv) {
	c := e.doneKey()
	r := e.mustInspect(c.Key)
	e.forget(r, true)
	e.wantMissing(c.Key, "after Forget")
	e.forget(r, false)
	// The old holder cannot touch what comes next.
	e.complete(c, false)
	e.release(c)
	e.wantMissing(c.Key, "a Complete and a Release by a holder from before Forget")
	next := e.won(c.Key, e.long())
	if next.Fence != 1 {
		t.Fatalf("claim after Forget: fence %d, want 1 (a new record)", next.Fence)
	}
	if next.Token == c.Token {
		t.Fatalf("claim after Forget reused the token %q", c.Token)
	}
	e.complete(c, false)
	e.release(c)
	e.extendLost(c, "a holder from before Forget")
	e.expect(c.Key, store.HeldByOther)
	e.complete(next, true)
	e.expect(c.Key, store.AlreadyDone)
	if got := e.mustInspect(c.Key); got.Version != store.VersionOf(next.Token) || got.Fence != 1 {
		t.Fatalf("after Forget and a new completion: %+v; want fence 1, version %q", got, store.VersionOf(next.Token))
	}

	// A done record past its ttl is forgotten too, while it is there.
	if e.h.Advance != nil {
		d := e.doneKey()
		e.pass(e.h.TTL)
		e.forget(e.mustInspect(d.Key), true)
		e.wantMissing(d.Key, "after Forget of an expired record")
	}
}

func opsForgetClaimed(t *testing.T, e *opsEnv) {
	live := e.won(e.key(), e.long())
	r := e.mustInspect(live.Key)
	e.forget(r, false)
	forged := r
	forged.State = store.Done
	e.forget(forged, false)
	e.unchanged(r, "Forget of a live claim")

	lapsed := e.lapsed()
	lr := e.mustInspect(lapsed.Key)
	e.forget(lr, false)
	lr.State = store.Done
	e.forget(lr, false)

	released := e.won(e.key(), e.long())
	e.release(released)
	rr := e.mustInspect(released.Key)
	e.forget(rr, false)
	e.unchanged(rr, "Forget of a released claim")

	e.expect(live.Key, store.HeldByOther)
	e.complete(live, true)
	next := e.won(lapsed.Key, e.long())
	if next.Fence != lapsed.Fence+1 {
		t.Fatalf("claim of a lapsed key after Forget: fence %d, want %d (the record kept)", next.Fence, lapsed.Fence+1)
	}
	e.complete(lapsed, false)
	if again := e.won(released.Key, e.long()); again.Fence != released.Fence+2 {
		t.Fatalf("claim of a released key after Forget: fence %d, want %d (the record kept)", again.Fence, released.Fence+2)
	}
}

func opsForgetStale(t *testing.T, e *opsEnv) {
	// Another version at the same fence.
	first := e.doneKey()
	gone := e.mustInspect(first.Key)
	e.forget(gone, true)
	again := e.won(first.Key, e.long())
	e.complete(again, true)
	fresh := e.mustInspect(first.Key)
	if fresh.Fence != gone.Fence {
		t.Fatalf("claim after Forget: fence %d, want %d", fresh.Fence, gone.Fence)
	}
	e.forget(gone, false)
	e.unchanged(fresh, "Forget of a record re-created since it was read")
	e.expect(first.Key, store.AlreadyDone)

	// Another fence: a record done at fence 2.
	old := e.lapsed()
	cur := e.won(old.Key, e.long())
	e.complete(cur, true)
	r := e.mustInspect(cur.Key)
	wrong := r
	wrong.Fence--
	e.forget(wrong, false)
	wrong.Fence = r.Fence + 1
	e.forget(wrong, false)
	wrong = r
	wrong.Version = store.VersionOf(old.Token)
	e.forget(wrong, false)
	e.unchanged(r, "Forget with another fence or version")
	e.expect(cur.Key, store.AlreadyDone)

	missing := store.Record{Key: e.key(), State: store.Done, Fence: 1, Version: store.VersionOf("nobody")}
	e.forget(missing, false)
	e.wantMissing(missing.Key, "Forget of a missing record")
}

func opsInvalid(t *testing.T, e *opsEnv) {
	for _, k := range []string{"", "nul\x00byte", strings.Repeat("x", store.MaxKeyLen+1)} {
		if r, ok, err := e.op.Inspect(e.ctx, k); ok || !errors.Is(err, store.ErrInvalidKey) {
			t.Errorf("Inspect(%.20q...) = %+v, %v, %v; want ErrInvalidKey", k, r, ok, err)
		}
		r := store.Record{Key: k, State: store.Claimed, Fence: 1, Version: store.VersionOf("t")}
		if ok, err := e.op.ForceRelease(e.ctx, r); ok || !errors.Is(err, store.ErrInvalidRecord) || !errors.Is(err, store.ErrInvalidKey) {
			t.Errorf("ForceRelease(key %.20q...) = %v, %v; want ErrInvalidRecord and ErrInvalidKey", k, ok, err)
		}
		r.State = store.Done
		if ok, err := e.op.Forget(e.ctx, r); ok || !errors.Is(err, store.ErrInvalidRecord) || !errors.Is(err, store.ErrInvalidKey) {
			t.Errorf("Forget(key %.20q...) = %v, %v; want ErrInvalidRecord and ErrInvalidKey", k, ok, err)
		}
	}
	// A record no read returns, for keys that hold records: refused, and
	// the records are as they were.
	live := e.won(e.key(), e.long())
	done := e.doneKey()
	lr, dr := e.mustInspect(live.Key), e.mustInspect(done.Key)
	for _, bad := range []func(r store.Record) store.Record{
		func(r store.Record) store.Record { r.Fence = 0; return r },
		func(r store.Record) store.Record { r.Fence = -1; return r },
		func(r store.Record) store.Record { r.Version = ""; return r },
	} {
		b := bad(lr)
		if ok, err := e.op.ForceRelease(e.ctx, b); ok || !errors.Is(err, store.ErrInvalidRecord) {
			t.Errorf("ForceRelease(fence %d, version %q) = %v, %v; want ErrInvalidRecord", b.Fence, b.Version, ok, err)
		}
		b = bad(dr)
		if ok, err := e.op.Forget(e.ctx, b); ok || !errors.Is(err, store.ErrInvalidRecord) {
			t.Errorf("Forget(fence %d, version %q) = %v, %v; want ErrInvalidRecord", b.Fence, b.Version, ok, err)
		}
	}
	e.unchanged(lr, "refused ForceReleases")
	e.unchanged(dr, "refused Forgets")
	e.complete(live, true)
}

func opsCancelled(t *testing.T, e *opsEnv) {
	dead, cancel := context.WithCancel(e.ctx)
	cancel()
	live := e.won(e.key(), e.long())
	done := e.doneKey()
	lr, dr := e.mustInspect(live.Key), e.mustInspect(done.Key)
	if _, _, err := e.op.Inspect(dead, live.Key); !errors.Is(err, context.Canceled) {
		t.Errorf("Inspect with a cancelled context: err = %v, want context.Canceled", err)
	}
	if _, err := e.op.List(dead, store.ListQuery{Prefix: live.Key}); !errors.Is(err, context.Canceled) {
		t.Errorf("List with a cancelled context: err = %v, want context.Canceled", err)
	}
	if ok, err := e.op.ForceRelease(dead, lr); ok || !errors.Is(err, context.Canceled) {
		t.Errorf("ForceRelease with a cancelled context = %v, %v; want context.Canceled", ok, err)
	}
	if ok, err := e.op.Forget(dead, dr); ok || !errors.Is(err, context.Canceled) {
		t.Errorf("Forget with a cancelled context = %v, %v; want context.Canceled", ok, err)
	}
	e.unchanged(lr, "a ForceRelease with a cancelled context")
	e.unchanged(dr, "a Forget with a cancelled context")
	e.expect(live.Key, store.HeldByOther)
	e.complete(live, true)
	e.expect(done.Key, store.AlreadyDone)
}

// raceOps runs n calls of f at once and returns how many answered true.
func (e *opsEnv) raceOps(what string, f func() (bool, error)) int {
	e.t.Helper()
	const n = 12
	var (
		wg    sync.WaitGroup
		start = make(chan struct{})
		oks   = make([]bool, n)
		errs  = make([]error, n)
	)
	for i := range n {
		wg.Go(func() {
			<-start
			oks[i], errs[i] = f()
		})
	}
	close(start)
	wg.Wait()
	won := 0
	for i := range n {
		if errs[i] != nil {
			e.t.Fatalf("%s racer %d: %v", what, i, errs[i])
		}
		if oks[i] {
			won++
		}
	}
	return won
}

func opsRace(t *testing.T, e *opsEnv) {
	c := e.won(e.key(), e.long())
	r := e.mustInspect(c.Key)
	if n := e.raceOps("ForceRelease", func() (bool, error) { return e.op.ForceRelease(e.ctx, r) }); n != 1 {
		t.Fatalf("%d racing ForceReleases of one record answered true, want exactly 1", n)
	}
	if got := e.mustInspect(c.Key); got.Fence != r.Fence+1 {
		t.Fatalf("after racing ForceReleases: fence %d, want %d (released once)", got.Fence, r.Fence+1)
	}

	d := e.doneKey()
	dr := e.mustInspect(d.Key)
	if n := e.raceOps("Forget", func() (bool, error) { return e.op.Forget(e.ctx, dr) }); n != 1 {
		t.Fatalf("%d racing Forgets of one record answered true, want exactly 1", n)
	}
	e.wantMissing(d.Key, "after racing Forgets")

	// A Forget racing the Claims that follow it never deletes their claim.
	f := e.doneKey()
	fr := e.mustInspect(f.Key)
	var wg sync.WaitGroup
	var claims []store.Result
	var mu sync.Mutex
	for range 4 {
		wg.Go(func() {
			res, err := e.h.Backend.Claim(e.ctx, f.Key, e.long())
			if err != nil {
				t.Errorf("Claim racing Forget: %v", err)
				return
			}
			mu.Lock()
			claims = append(claims, res)
			mu.Unlock()
		})
	}
	e.forget(fr, true)
	wg.Wait()
	if t.Failed() {
		return
	}
	var winner *store.Claim
	for _, res := range claims {
		if res.Outcome == store.Won {
			if winner != nil {
				t.Fatalf("two claims won the key after Forget: fences %d and %d", winner.Fence, res.Claim.Fence)
			}
			winner = &res.Claim
		}
	}
	if winner == nil {
		c := e.won(f.Key, e.long())
		winner = &c
	}
	e.forget(fr, false)
	e.expect(f.Key, store.HeldByOther)
	e.complete(*winner, true)
}

func opsLost(t *testing.T, e *opsEnv) {
	faults := e.faults()
	c := e.won(e.key(), e.long())
	r := e.mustInspect(c.Key)
	faults.LoseNextReply()
	trues := 0
	for try := range 3 {
		ok, err := e.op.ForceRelease(e.ctx, r)
		if err != nil && try == 2 {
			t.Fatalf("ForceRelease, try %d after a lost reply: %v", try+1, err)
		}
		if ok && err == nil {
			trues++
		}
		if err == nil {
			break
		}
	}
	if trues > 1 {
		t.Fatalf("ForceRelease answered true %d times for one record", trues)
	}
	if got := e.mustInspect(c.Key); got.Fence != r.Fence+1 || got.State != store.Claimed {
		t.Fatalf("after ForceRelease retried past a lost reply: %+v; want claimed, fence %d (released once)", got, r.Fence+1)
	}
	e.complete(c, false)

	d := e.doneKey()
	dr := e.mustInspect(d.Key)
	faults.LoseNextReply()
	trues = 0
	for try := range 3 {
		ok, err := e.op.Forget(e.ctx, dr)
		if err != nil && try == 2 {
			t.Fatalf("Forget, try %d after a lost reply: %v", try+1, err)
		}
		if ok && err == nil {
			trues++
		}
		if err == nil {
			break
		}
	}
	if trues > 1 {
		t.Fatalf("Forget answered true %d times for one record", trues)
	}
	e.wantMissing(d.Key, "after Forget retried past a lost reply")
	next := e.won(d.Key, e.long())
	if next.Fence != 1 {
		t.Fatalf("claim after Forget: fence %d, want 1", next.Fence)
	}
	// An operator who retries later, after the key was claimed again,
	// deletes nothing.
	e.complete(next, true)
	fresh := e.mustInspect(d.Key)
	e.forget(dr, false)
	e.unchanged(fresh, "a Forget retried after the key was claimed and completed again")
}
