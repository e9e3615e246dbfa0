package redislock_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// snapshot is a raw key's value and expiry, to show an operation left it
// alone.
func snapshot(t *testing.T, c *redis.Client, raw string) string {
	t.Helper()
	ctx := t.Context()
	typ := c.Type(ctx, raw).Val()
	var v any
	switch typ {
	case "string":
		v = c.Get(ctx, raw).Val()
	case "hash":
		v = c.HGetAll(ctx, raw).Val()
	}
	return fmt.Sprintf("%s %v %d", typ, v, c.Do(ctx, "PEXPIRETIME", raw).Val())
}

func inspect(t *testing.T, b *redislock.Backend, key string) store.Record {
	t.Helper()
	r, ok, err := b.Inspect(t.Context(), key)
	if err != nil || !ok {
		t.Fatalf("inspect %q: %v %v", key, ok, err)
	}
	return r
}

// Inspect reports the record as stored, with the server's clock at the
// read and the digest of the token, and changes nothing.
func TestInspectReportsTheStoredRecordAndChangesNothing(t *testing.T) {
	const ttl = time.Hour
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c, redislock.WithTTL(ttl))
	ctx := t.Context()
	raw := prefixOf(b) + "k"

	if _, ok, err := b.Inspect(ctx, "k"); ok || err != nil {
		t.Fatalf("inspect of no record: %v %v", ok, err)
	}
	before := serverNow(t, c)
	res, err := b.Claim(ctx, "k", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	was := snapshot(t, c, raw)
	r := inspect(t, b, "k")
	after := serverNow(t, c)
	if was != snapshot(t, c, raw) {
		t.Fatalf("inspect changed the record: %s, now %s", was, snapshot(t, c, raw))
	}
	want := store.Record{Key: "k", State: store.Claimed, Fence: 1, LeaseExpiry: res.Claim.LeaseExpiry,
		ExpiresAt: res.Claim.LeaseExpiry.Add(ttl), Version: store.VersionOf(res.Claim.Token), Now: r.Now}
	if r != want {
		t.Fatalf("inspect of a claim:\n got %+v\nwant %+v", r, want)
	}
	if r.Now.Before(before.Truncate(time.Millisecond)) || r.Now.After(after) || r.Reclaimable() {
		t.Fatalf("now %v is not the server's between %v and %v, or a live lease reads reclaimable", r.Now, before, after)
	}
	if r.Version == res.Claim.Token || len(r.Version) != 16 {
		t.Fatalf("version %q is not a digest of the token", r.Version)
	}

	if ok, err := b.CompleteFingerprint(ctx, res.Claim, "fp,with,commas"); !ok || err != nil {
		t.Fatal(ok, err)
	}
	r = inspect(t, b, "k")
	exp, err := c.Do(ctx, "PEXPIRETIME", raw).Int64()
	if err != nil {
		t.Fatal(err)
	}
	want = store.Record{Key: "k", State: store.Done, Fence: 1, ExpiresAt: time.UnixMilli(exp),
		Fingerprint: "fp,with,commas", Version: store.VersionOf(res.Claim.Token), Now: r.Now}
	if r != want || r.Reclaimable() {
		t.Fatalf("inspect of a done record:\n got %+v\nwant %+v", r, want)
	}

	// A done key without an expiry stays done for good, as Claim says.
	if err := c.Persist(ctx, raw).Err(); err != nil {
		t.Fatal(err)
	}
	if r = inspect(t, b, "k"); !r.ExpiresAt.Equal(store.MaxInstant) || r.Reclaimable() {
		t.Fatalf("a done key without an expiry: %+v", r)
	}

	// Something that is not a record is an error.
	if err := c.Set(ctx, prefixOf(b)+"junk", "hello", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	if _, _, err := b.Inspect(ctx, "junk"); err == nil {
		t.Fatal("inspect of a key that is not a record: no error")
	}
}

// A record of the earlier hash format is read as the same record.
func TestInspectReadsTheEarlierFormat(t *testing.T) {
	const ttl = time.Hour
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c, redislock.WithTTL(ttl))
	raw := prefixOf(b) + "old"
	cl := v1Claim(t, c, "old", raw, time.Minute, ttl)
	r := inspect(t, b, "old")
	want := store.Record{Key: "old", State: store.Claimed, Fence: 1, LeaseExpiry: cl.LeaseExpiry,
		ExpiresAt: cl.LeaseExpiry.Add(ttl), Version: store.VersionOf(cl.Token), Now: r.Now}
	if r != want {
		t.Fatalf("inspect of a v1 claim:\n got %+v\nwant %+v", r, want)
	}
	ok, err := b.ForceRelease(t.Context(), r)
	if !ok || err != nil {
		t.Fatalf("force-release of a v1 claim: %v %v", ok, err)
	}
	if r := inspect(t, b, "old"); r.Fence != 2 || !r.Reclaimable() || r.Version != want.Version {
		t.Fatalf("after force-release: %+v", r)
	}
}

// Every operation validates its arguments before any I/O: on a client
// whose server does not exist, the error is the validation's.
func TestOpsValidateBeforeAnyIO(t *testing.T) {
	b := newBackend(t, client(t, "127.0.0.1:1", oneDial))
	ctx := t.Context()
	if _, _, err := b.Inspect(ctx, ""); !errors.Is(err, store.ErrInvalidKey) {
		t.Errorf("inspect of an empty key: %v", err)
	}
	good := store.Record{Key: "k", Fence: 1, Version: store.VersionOf("t")}
	for _, r := range []store.Record{{Key: "", Fence: 1, Version: "v"}, {Key: "k", Fence: 0, Version: "v"}, {Key: "k", Fence: 1}} {
		if _, err := b.ForceRelease(ctx, r); !errors.Is(err, store.ErrInvalidRecord) {
			t.Errorf("force-release of %+v: %v", r, err)
		}
		if _, err := b.Forget(ctx, r); !errors.Is(err, store.ErrInvalidRecord) {
			t.Errorf("forget of %+v: %v", r, err)
		}
	}
	if _, err := b.Forget(ctx, good); err == nil || errors.Is(err, store.ErrInvalidRecord) {
		t.Errorf("forget of a valid record on a dead server: %v", err)
	}
	// A cursor another backend (another prefix) issued, or garbage.
	other := newBackend(t, client(t, testsvc.Redis(t)))
	for _, k := range []string{"a", "b"} {
		if _, err := other.Claim(ctx, k, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	page, err := other.List(ctx, store.ListQuery{Limit: 1})
	if err != nil || page.Next == "" {
		t.Fatalf("no continuation to test with: %+v %v", page, err)
	}
	for _, q := range []store.ListQuery{
		{Limit: -1}, {Limit: store.MaxListLimit + 1}, {State: 7}, {Prefix: "a\x00"},
		{Cursor: "nonsense"}, {Cursor: "r1.AAAA"}, {Cursor: page.Next},
	} {
		if _, err := b.List(ctx, q); !errors.Is(err, store.ErrInvalidQuery) {
			t.Errorf("list %+v: %v", q, err)
		}
	}
}

// ForceRelease frees a claim, live or lapsed, at a higher fence, keeping
// its token as Release does: the old holder is fenced out, the next Claim
// wins at once. Any other record, or a repeat, is left alone.
func TestForceReleaseFencesOutTheHolder(t *testing.T) {
	const ttl = time.Hour
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c, redislock.WithTTL(ttl))
	ctx := t.Context()
	raw := prefixOf(b) + "k"
	res, err := b.Claim(ctx, "k", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	r := inspect(t, b, "k")
	was := snapshot(t, c, raw)
	for _, stale := range []store.Record{
		{Key: "k", Fence: 2, Version: r.Version},
		{Key: "k", Fence: 1, Version: store.VersionOf("another token")},
		{Key: "other", Fence: 1, Version: r.Version},
	} {
		if ok, err := b.ForceRelease(ctx, stale); ok || err != nil {
			t.Fatalf("force-release of %+v: %v %v", stale, ok, err)
		}
		if was != snapshot(t, c, raw) {
			t.Fatalf("force-release of %+v changed the record", stale)
		}
	}
	if ok, err := b.ForceRelease(ctx, r); !ok || err != nil {
		t.Fatalf("force-release: %v %v", ok, err)
	}
	after := inspect(t, b, "k")
	if after.State != store.Claimed || after.Fence != 2 || after.Version != r.Version || !after.Reclaimable() ||
		!after.LeaseExpiry.Equal(after.ExpiresAt.Add(-ttl)) {
		t.Fatalf("after force-release: %+v", after)
	}
	if ok, err := b.ForceRelease(ctx, r); ok || err != nil {
		t.Fatalf("a second force-release: %v %v", ok, err)
	}
	if ok, err := b.Complete(ctx, res.Claim); ok || err != nil {
		t.Fatalf("the old holder completed: %v %v", ok, err)
	}
	if _, err := b.Extend(ctx, res.Claim, time.Minute); !errors.Is(err, store.ErrLost) {
		t.Fatalf("the old holder extended: %v", err)
	}
	next, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || next.Outcome != store.Won || next.Claim.Fence != 3 {
		t.Fatalf("the next claim: %+v %v", next, err)
	}
	if ok, err := b.Complete(ctx, next.Claim); !ok || err != nil {
		t.Fatal(ok, err)
	}
	done := inspect(t, b, "k")
	was = snapshot(t, c, raw)
	if ok, err := b.ForceRelease(ctx, done); ok || err != nil || was != snapshot(t, c, raw) {
		t.Fatalf("force-release of a done record: %v %v", ok, err)
	}
}

// Forget deletes a done record that is still the one read, and nothing
// else: not a claim, not a record of another fence or version, not a
// record created afresh since the read.
func TestForgetDeletesOnlyTheDoneRecordRead(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c, redislock.WithTTL(time.Hour))
	ctx := t.Context()
	raw := prefixOf(b) + "k"
	res, err := b.Claim(ctx, "k", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	claimed := inspect(t, b, "k")
	was := snapshot(t, c, raw)
	if ok, err := b.Forget(ctx, claimed); ok || err != nil || was != snapshot(t, c, raw) {
		t.Fatalf("forget of a claim: %v %v", ok, err)
	}
	if ok, err := b.Complete(ctx, res.Claim); !ok || err != nil {
		t.Fatal(ok, err)
	}
	done := inspect(t, b, "k")
	was = snapshot(t, c, raw)
	for _, stale := range []store.Record{
		{Key: "k", Fence: 2, Version: done.Version},
		{Key: "k", Fence: 1, Version: store.VersionOf("another token")},
	} {
		if ok, err := b.Forget(ctx, stale); ok || err != nil || was != snapshot(t, c, raw) {
			t.Fatalf("forget of %+v: %v %v", stale, ok, err)
		}
	}
	if ok, err := b.Forget(ctx, done); !ok || err != nil {
		t.Fatalf("forget: %v %v", ok, err)
	}
	if _, ok, err := b.Inspect(ctx, "k"); ok || err != nil {
		t.Fatalf("after forget: %v %v", ok, err)
	}
	if ok, err := b.Forget(ctx, done); ok || err != nil {
		t.Fatalf("a second forget: %v %v", ok, err)
	}
	// The key runs again, at fence 1 with a new token: the first read
	// (same fence, another version) does not delete it.
	again, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || again.Outcome != store.Won || again.Claim.Fence != 1 {
		t.Fatalf("claim after forget: %+v %v", again, err)
	}
	if ok, err := b.Complete(ctx, again.Claim); !ok || err != nil {
		t.Fatal(ok, err)
	}
	was = snapshot(t, c, raw)
	if ok, err := b.Forget(ctx, done); ok || err != nil || was != snapshot(t, c, raw) {
		t.Fatalf("forget of the earlier record deleted the new one: %v %v", ok, err)
	}
}

// listAll follows a listing to its end, checking every page's bound, and
// returns the keys it reported (with repeats) and the pages it took.
func listAll(t *testing.T, b *redislock.Backend, q store.ListQuery) (keys []string, pages int) {
	keys, pages, _ = listCounting(t, b, q)
	return keys, pages
}

// listCounting is listAll that also counts the pages that ended within a
// SCAN reply (their Next resumes at the same SCAN cursor).
func listCounting(t *testing.T, b *redislock.Backend, q store.ListQuery) (keys []string, pages, cut int) {
	t.Helper()
	limit := q.Limit
	if limit == 0 {
		limit = store.DefaultListLimit
	}
	for {
		p, err := b.List(t.Context(), q)
		if err != nil {
			t.Fatal(err)
		}
		pages++
		if len(p.Records) > limit {
			t.Fatalf("a page of %d records, limit %d", len(p.Records), limit)
		}
		for _, r := range p.Records {
			if q.State != 0 && r.State != q.State {
				t.Fatalf("state %v listed for %v: %+v", r.State, q.State, r)
			}
			keys = append(keys, r.Key)
		}
		if p.Next == "" {
			return keys, pages, cut
		}
		if redislock.SeenInCursor(b, q, p.Next) > 0 {
			cut++
		}
		if pages > 100000 {
			t.Fatal("the listing does not end")
		}
		q.Cursor = p.Next
	}
}

// List matches the prefixes literally: glob characters in the backend's
// prefix or the query's select nothing but themselves.
func TestListMatchesPrefixesLiterally(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	ctx := t.Context()
	base := prefix()
	b, err := redislock.New(c, redislock.WithPrefix(base+`[ab]*?\:`))
	if err != nil {
		t.Fatal(err)
	}
	// A backend whose keys the prefix would match if read as a pattern.
	near, err := redislock.New(c, redislock.WithPrefix(base+"axy:"))
	if err != nil {
		t.Fatal(err)
	}
	keys := []string{`*`, `a*b`, `a?b`, `axb`, `a[x]b`, `ab`, `a\b`, `a\*b`, `[a-z]`, `-`, `^`}
	for _, k := range keys {
		for _, be := range []*redislock.Backend{b, near} {
			if _, err := be.Claim(ctx, k, time.Minute); err != nil {
				t.Fatal(err)
			}
		}
	}
	got, _ := listAll(t, b, store.ListQuery{})
	slices.Sort(got)
	want := slices.Sorted(slices.Values(keys))
	if !slices.Equal(slices.Compact(got), want) {
		t.Fatalf("listed %q, want %q", got, want)
	}
	for _, p := range keys {
		got, _ := listAll(t, b, store.ListQuery{Prefix: p, Limit: 2})
		var want []string
		for _, k := range keys {
			if len(k) >= len(p) && k[:len(p)] == p {
				want = append(want, k)
			}
		}
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(slices.Compact(got), want) {
			t.Errorf("prefix %q: listed %q, want %q", p, got, want)
		}
	}
}

// A listing at any limit reports every record under the prefix in the
// selected state, each page within its limit, and none outside; the
// records read as Inspect reads them.
func TestListReportsEveryRecordWithinTheLimit(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c, redislock.WithTTL(time.Hour))
	ctx := t.Context()
	want := map[store.State][]string{}
	for i := range 300 {
		k := fmt.Sprintf("p:%03d", i)
		res, err := b.Claim(ctx, k, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		st := store.Claimed
		if i%3 == 0 {
			if ok, err := b.Complete(ctx, res.Claim); !ok || err != nil {
				t.Fatal(ok, err)
			}
			st = store.Done
		}
		want[st] = append(want[st], k)
		want[0] = append(want[0], k)
	}
	// Outside the prefix: not listed.
	if _, err := b.Claim(ctx, "q:000", time.Minute); err != nil {
		t.Fatal(err)
	}
	cuts := 0
	for _, limit := range []int{1, 2, 3, 7, 0, store.MaxListLimit} {
		for _, st := range []store.State{0, store.Claimed, store.Done} {
			got, pages, cut := listCounting(t, b, store.ListQuery{Prefix: "p:", State: st, Limit: limit})
			cuts += cut
			slices.Sort(got)
			if !slices.Equal(slices.Compact(got), want[st]) {
				t.Fatalf("limit %d state %v: listed %d keys, want %d", limit, st, len(slices.Compact(got)), len(want[st]))
			}
			t.Logf("limit %d state %v: %d records (%d repeats) in %d pages, %d cut within a SCAN reply", limit, st, len(got), len(got)-len(slices.Compact(got)), pages, cut)
		}
	}
	// SCAN replies hold more keys than a small page has room for (COUNT
	// is a hint, and a reply holds whole hash buckets): the listings above
	// must have resumed within one, or they did not test it.
	if cuts == 0 {
		t.Fatal("no page ended within a SCAN reply")
	}
	p, err := b.List(ctx, store.ListQuery{Prefix: "p:00", Limit: store.MaxListLimit})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range p.Records {
		if in := inspect(t, b, r.Key); in.Now.Before(r.Now) || (in != store.Record{Now: in.Now, Key: r.Key, State: r.State, Fence: r.Fence,
			LeaseExpiry: r.LeaseExpiry, ExpiresAt: r.ExpiresAt, Fingerprint: r.Fingerprint, Version: r.Version}) {
			t.Fatalf("listed %+v, inspect reads %+v", r, in)
		}
	}
}

// A listing with a small page through a large keyspace finishes in a few
// calls: each SCAN examines at least 100 keys, whatever the limit. With
// COUNT = the limit, listing 3 records one per page among 20,000 other
// keys took about 20,000 / 16 calls (SCAN COUNT 1, 16 per call), and under
// load outlived the records it was to report (a 2s ttl in the suite).
func TestListCrossesALargeKeyspaceInFewCalls(t *testing.T) {
	srv := testsvc.StartRedis(t)
	c := client(t, srv.Addr)
	b := newBackend(t, c, redislock.WithTTL(time.Hour))
	ctx := t.Context()
	const others = 20000
	pipe := c.Pipeline()
	for i := range others {
		pipe.Set(ctx, fmt.Sprintf("other:%d", i), "x", 0)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"a", "b", "c"} {
		if _, err := b.Claim(ctx, k, time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	got, pages := listAll(t, b, store.ListQuery{Limit: 1})
	slices.Sort(got)
	if !slices.Equal(slices.Compact(got), []string{"a", "b", "c"}) {
		t.Fatalf("listed %q", got)
	}
	// 20,003 keys, at least 100 examined per SCAN, 16 SCANs per call:
	// some 13 calls, plus one per record (a page of one ends the call).
	if max := others/(100*16) + 1 + 3 + 3; pages > max {
		t.Fatalf("%d calls to list 3 records among %d keys, want at most %d", pages, others, max)
	}
	t.Logf("%d calls", pages)
}
