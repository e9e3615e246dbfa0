package spannerlock_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"cloud.google.com/go/spanner"
	"google.golang.org/grpc/codes"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
)

// inspect returns key's record, failing t on an error.
func inspect(t *testing.T, b *spannerlock.Backend, key string) (store.Record, bool) {
	t.Helper()
	rec, ok, err := b.Inspect(t.Context(), key)
	if err != nil {
		t.Fatalf("inspect %q: %v", key, err)
	}
	return rec, ok
}

// claim claims key for lease and wants it won.
func claim(t *testing.T, b *spannerlock.Backend, key string, lease time.Duration) store.Claim {
	t.Helper()
	res, err := b.Claim(t.Context(), key, lease)
	if err != nil || res.Outcome != store.Won {
		t.Fatalf("claim %q: %+v %v; want won", key, res, err)
	}
	return res.Claim
}

// Inspect reports the stored record with Spanner's time of the read, the
// token's version and never the token, and changes nothing (one RPC).
func TestInspect(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	b, r := newBackend(t, "")
	if rec, ok := inspect(t, b, "k"); ok {
		t.Fatalf("inspect of an absent key: %+v", rec)
	}
	if _, _, err := b.Inspect(ctx, ""); !errors.Is(err, store.ErrInvalidKey) {
		t.Fatalf("inspect of the empty key: %v; want ErrInvalidKey", err)
	}
	c := claim(t, b, "k", time.Hour)
	r.take()
	rec, ok := inspect(t, b, "k")
	if got := r.take(); !slices.Equal(got, []string{"ExecuteStreamingSql"}) {
		t.Errorf("inspect RPCs: %v; want one query", got)
	}
	want := store.Record{Key: "k", State: store.Claimed, Fence: 1, LeaseExpiry: c.LeaseExpiry, Version: store.VersionOf(c.Token)}
	if !ok || rec.Key != want.Key || rec.State != want.State || rec.Fence != want.Fence || !rec.LeaseExpiry.Equal(want.LeaseExpiry) || rec.Version != want.Version || rec.Fingerprint != "" {
		t.Fatalf("inspect of a claim: %+v %v; want %+v", rec, ok, want)
	}
	if rec.Version == c.Token || len(rec.Version) != 16 {
		t.Fatalf("version %q of token %q", rec.Version, c.Token)
	}
	if lo := c.LeaseExpiry.Add(-time.Hour); rec.Now.Before(lo) || !rec.Now.Before(c.LeaseExpiry) || rec.Reclaimable() {
		t.Fatalf("now %v, lease expiry %v: want now within the lease", rec.Now, c.LeaseExpiry)
	}
	if !rec.ExpiresAt.Equal(c.LeaseExpiry.Add(b.TTL())) {
		t.Fatalf("expires at %v; want the lease expiry + ttl %v", rec.ExpiresAt, c.LeaseExpiry.Add(b.TTL()))
	}
	again, _ := inspect(t, b, "k")
	again.Now = rec.Now
	if again != rec {
		t.Fatalf("a second inspect: %+v; want %+v", again, rec)
	}
	if ok, err := b.CompleteFingerprint(ctx, c, "fp1"); !ok || err != nil {
		t.Fatalf("complete: %v %v", ok, err)
	}
	rec, ok = inspect(t, b, "k")
	if !ok || rec.State != store.Done || rec.Fence != 1 || rec.Fingerprint != "fp1" || rec.Version != store.VersionOf(c.Token) || !rec.ExpiresAt.After(rec.Now) {
		t.Fatalf("inspect of a done record: %+v %v", rec, ok)
	}
}

// ForceRelease frees a claim (live) with a higher fence, fencing out its
// holder, only when fence, version and state match; a second call with
// the same record changes nothing.
func TestForceRelease(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	b, r := newBackend(t, "")
	c := claim(t, b, "k", time.Hour)
	rec, _ := inspect(t, b, "k")
	for _, bad := range []store.Record{
		{Key: "k", Fence: 2, Version: rec.Version},
		{Key: "k", Fence: 1, Version: store.VersionOf("another token")},
		{Key: "absent", Fence: 1, Version: rec.Version},
	} {
		if ok, err := b.ForceRelease(ctx, bad); ok || err != nil {
			t.Fatalf("force-release of %+v: %v %v; want false", bad, ok, err)
		}
	}
	if ok, err := b.ForceRelease(ctx, store.Record{Key: "k", Fence: 0, Version: rec.Version}); ok || !errors.Is(err, store.ErrInvalidRecord) {
		t.Fatalf("force-release of fence 0: %v %v; want ErrInvalidRecord", ok, err)
	}
	if got, _ := inspect(t, b, "k"); got.Fence != 1 || !got.LeaseExpiry.Equal(c.LeaseExpiry) {
		t.Fatalf("refused force-releases changed the record: %+v", got)
	}
	r.take()
	if ok, err := b.ForceRelease(ctx, rec); !ok || err != nil {
		t.Fatalf("force-release: %v %v; want true", ok, err)
	}
	if got := r.take(); len(got) != 2 || got[1] != "Commit" {
		t.Errorf("force-release RPCs: %v; want a statement and a Commit", got)
	}
	got, _ := inspect(t, b, "k")
	if got.State != store.Claimed || got.Fence != 2 || got.Version != rec.Version || !got.Reclaimable() || got.LeaseExpiry.Before(rec.Now) {
		t.Fatalf("after force-release: %+v; want claimed, fence 2, same version, lease expired at the release", got)
	}
	if !got.ExpiresAt.Equal(got.LeaseExpiry.Add(b.TTL())) {
		t.Fatalf("after force-release: expires at %v; want the release time + ttl", got.ExpiresAt)
	}
	if ok, err := b.ForceRelease(ctx, rec); ok || err != nil {
		t.Fatalf("a second force-release of the same record: %v %v; want false", ok, err)
	}
	if ok, err := b.Complete(ctx, c); ok || err != nil {
		t.Fatalf("the old holder's complete: %v %v; want false", ok, err)
	}
	if _, err := b.Extend(ctx, c, time.Hour); !errors.Is(err, store.ErrLost) {
		t.Fatalf("the old holder's extend: %v; want ErrLost", err)
	}
	next := claim(t, b, "k", time.Hour)
	if next.Fence != 3 {
		t.Fatalf("the next claim has fence %d; want 3", next.Fence)
	}
	if ok, err := b.Complete(ctx, next); !ok || err != nil {
		t.Fatal(ok, err)
	}
	done, _ := inspect(t, b, "k")
	if ok, err := b.ForceRelease(ctx, done); ok || err != nil {
		t.Fatalf("force-release of a done record: %v %v; want false", ok, err)
	}
	if got, _ := inspect(t, b, "k"); got.State != store.Done || got.Fence != 3 {
		t.Fatalf("force-release of a done record changed it: %+v", got)
	}
}

// A force-release whose Commit applied but whose reply was lost releases
// once: the Spanner client resends the Commit (Unavailable) or runs the
// transaction again (Internal), and the rerun's statement finds the
// raised fence. The call may say false, never true for a release it did
// not make, and the fence is raised by one.
func TestForceReleaseLostReply(t *testing.T) {
	testsvc.Spanner(t)
	for _, code := range []codes.Code{codes.Unavailable, codes.Internal} {
		t.Run(code.String(), func(t *testing.T) {
			ctx := t.Context()
			b, r := newBackend(t, "")
			claim(t, b, "k", time.Hour)
			rec, _ := inspect(t, b, "k")
			r.lostCode = code
			r.loseNextCommit.Store(true)
			ok, err := b.ForceRelease(ctx, rec)
			if r.lost.Load() != 1 {
				t.Fatalf("%d replies lost, want 1", r.lost.Load())
			}
			t.Logf("force-release after a lost reply: %v %v; RPCs %v", ok, err, r.take())
			got, _ := inspect(t, b, "k")
			if got.Fence != 2 || !got.Reclaimable() {
				t.Fatalf("after a force-release whose reply was lost: %+v; want released once, fence 2", got)
			}
		})
	}
}

// A force-release whose Commit failed without applying reports false or
// an error, never true, and changes nothing.
func TestForceReleaseRefusedCommit(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	b, r := newBackend(t, "", spannerlock.WithRetries(0))
	c := claim(t, b, "k", time.Hour)
	rec, _ := inspect(t, b, "k")
	r.refuse.Store(&refusal{method: "Commit", code: codes.PermissionDenied})
	if ok, err := b.ForceRelease(ctx, rec); ok || err == nil {
		t.Fatalf("force-release whose Commit was refused: %v %v; want false and an error", ok, err)
	}
	if got, _ := inspect(t, b, "k"); got.Fence != 1 || !got.LeaseExpiry.Equal(c.LeaseExpiry) {
		t.Fatalf("a refused force-release changed the record: %+v", got)
	}
}

// Forget deletes a Done record only with its fence and version, never a
// Claimed one (live or lapsed); the next claim starts at fence 1.
func TestForget(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	b, r := newBackend(t, "")
	c := claim(t, b, "k", time.Millisecond)
	time.Sleep(5 * time.Millisecond)
	lapsed, _ := inspect(t, b, "k")
	if !lapsed.Reclaimable() {
		t.Fatalf("a claim of 1ms is not reclaimable 5ms later: %+v", lapsed)
	}
	if ok, err := b.Forget(ctx, lapsed); ok || err != nil {
		t.Fatalf("forget of a lapsed claim: %v %v; want false", ok, err)
	}
	live := claim(t, b, "k", time.Hour)
	liveRec, _ := inspect(t, b, "k")
	if ok, err := b.Forget(ctx, liveRec); ok || err != nil {
		t.Fatalf("forget of a live claim: %v %v; want false", ok, err)
	}
	if ok, err := b.Complete(ctx, live); !ok || err != nil {
		t.Fatal(ok, err)
	}
	if ok, err := b.Complete(ctx, c); ok || err != nil {
		t.Fatalf("complete by the replaced holder: %v %v", ok, err)
	}
	done, _ := inspect(t, b, "k")
	for _, bad := range []store.Record{
		{Key: "k", Fence: done.Fence + 1, Version: done.Version},
		{Key: "k", Fence: done.Fence, Version: store.VersionOf(c.Token)},
	} {
		if ok, err := b.Forget(ctx, bad); ok || err != nil {
			t.Fatalf("forget of %+v: %v %v; want false", bad, ok, err)
		}
	}
	if ok, err := b.Forget(ctx, store.Record{Key: "k", Fence: 2}); ok || !errors.Is(err, store.ErrInvalidRecord) {
		t.Fatalf("forget without a version: %v %v; want ErrInvalidRecord", ok, err)
	}
	r.take()
	if ok, err := b.Forget(ctx, done); !ok || err != nil {
		t.Fatalf("forget: %v %v; want true", ok, err)
	}
	if got := r.take(); len(got) != 2 || got[1] != "Commit" {
		t.Errorf("forget RPCs: %v; want a statement and a Commit", got)
	}
	if rec, ok := inspect(t, b, "k"); ok {
		t.Fatalf("after forget: %+v", rec)
	}
	if ok, err := b.Forget(ctx, done); ok || err != nil {
		t.Fatalf("a second forget: %v %v; want false", ok, err)
	}
	if ok, err := b.Complete(ctx, live); ok || err != nil {
		t.Fatalf("complete by the holder of the forgotten record: %v %v; want false", ok, err)
	}
	if next := claim(t, b, "k", time.Hour); next.Fence != 1 {
		t.Fatalf("the claim after forget has fence %d; want 1", next.Fence)
	}
	// A record recreated since it was read is not the one read.
	c2, _ := inspect(t, b, "k")
	if c2.Version == done.Version {
		t.Fatal("the recreated record has the forgotten one's version")
	}
}

// listAll follows Next from q and returns the keys, failing on a page
// above the limit or a key seen twice.
func listAll(t *testing.T, b *spannerlock.Backend, q store.ListQuery) ([]string, int) {
	t.Helper()
	var keys []string
	pages := 0
	for {
		p, err := b.List(t.Context(), q)
		if err != nil {
			t.Fatalf("list %+v: %v", q, err)
		}
		pages++
		limit := q.Limit
		if limit == 0 {
			limit = store.DefaultListLimit
		}
		if len(p.Records) > limit {
			t.Fatalf("a page of %d records, limit %d", len(p.Records), limit)
		}
		for _, r := range p.Records {
			if q.State != 0 && r.State != q.State {
				t.Fatalf("list of state %v reported %+v", q.State, r)
			}
			if r.Now.IsZero() || r.Version == "" {
				t.Fatalf("record without now or version: %+v", r)
			}
			keys = append(keys, r.Key)
		}
		if p.Next == "" {
			break
		}
		q.Cursor = p.Next
		if pages > 1000 {
			t.Fatal("the listing does not end")
		}
	}
	return keys, pages
}

// List reads keys in order under the prefix (a key range, with keys
// whose bytes are 0xFF at the edge), filters the state in the query, and
// pages with a cursor it refuses for another query.
func TestList(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	b, r := newBackend(t, "")
	var claimed, done []string
	for i := range 7 {
		k := fmt.Sprintf("a/%d", i)
		c := claim(t, b, k, time.Hour)
		if i%3 == 0 {
			if ok, err := b.Complete(ctx, c); !ok || err != nil {
				t.Fatal(ok, err)
			}
			done = append(done, k)
		} else {
			claimed = append(claimed, k)
		}
	}
	for _, k := range []string{"a", "a.", "b/1", "a\xff", "a\xff\xff/x", "\xff\xff"} {
		claim(t, b, k, time.Hour)
	}
	all := append(slices.Clone(claimed), done...)
	slices.Sort(all)
	r.take()
	p, err := b.List(ctx, store.ListQuery{Prefix: "a/"})
	if err != nil || p.Next != "" || len(p.Records) != 7 {
		t.Fatalf("list a/: %d records, next %q, %v", len(p.Records), p.Next, err)
	}
	if got := r.take(); !slices.Equal(got, []string{"ExecuteStreamingSql"}) {
		t.Errorf("list RPCs: %v; want one query", got)
	}
	for i, rec := range p.Records {
		want, _ := inspect(t, b, rec.Key)
		want.Now = rec.Now
		if rec.Key != all[i] || rec != want {
			t.Fatalf("record %d: %+v; want %+v", i, rec, want)
		}
	}
	for _, tc := range []struct {
		q    store.ListQuery
		want []string
	}{
		{store.ListQuery{Prefix: "a/", Limit: 2}, all},
		{store.ListQuery{Prefix: "a/", Limit: 1, State: store.Claimed}, claimed},
		{store.ListQuery{Prefix: "a/", Limit: 2, State: store.Done}, done},
		{store.ListQuery{Prefix: "a/", Limit: 3, State: store.Done}, done},
		{store.ListQuery{Prefix: "a\xff"}, []string{"a\xff", "a\xff\xff/x"}},
		{store.ListQuery{Prefix: "\xff", Limit: 1}, []string{"\xff\xff"}},
		{store.ListQuery{Prefix: "a/9"}, nil},
		{store.ListQuery{Limit: 4}, append(append([]string{"a", "a."}, all...), "a\xff", "a\xff\xff/x", "b/1", "\xff\xff")},
	} {
		got, pages := listAll(t, b, tc.q)
		if !slices.Equal(got, tc.want) {
			t.Errorf("list %+v: %q; want %q", tc.q, got, tc.want)
		}
		t.Logf("list %+v: %d pages", tc.q, pages)
	}
	p, err = b.List(ctx, store.ListQuery{Prefix: "a/", Limit: 2})
	if err != nil || p.Next == "" {
		t.Fatal(p, err)
	}
	r.take()
	for _, q := range []store.ListQuery{
		{Prefix: "b/", Cursor: p.Next},
		{Prefix: "a", Cursor: p.Next},
		{Prefix: "a/", State: store.Done, Cursor: p.Next},
		{Prefix: "a/", Cursor: "!!"},
		{Prefix: "a/", Cursor: p.Next[:len(p.Next)-2]},
		{Prefix: "a/", Limit: store.MaxListLimit + 1},
		{Prefix: "a/", State: 7},
	} {
		if _, err := b.List(ctx, q); !errors.Is(err, store.ErrInvalidQuery) {
			t.Errorf("list %+v: %v; want ErrInvalidQuery", q, err)
		}
	}
	if got := r.take(); len(got) != 0 {
		t.Errorf("refused queries sent RPCs: %v", got)
	}
}

// With a state filter a call reads at most ListScan rows: a page of a
// state that only rows beyond the scan are in is empty with Next set,
// and the listing still finds them.
func TestListScanBound(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	c := newClient(t, database(t), testsvc.Spanner(t), &rpcs{})
	b, err := spannerlock.New(c)
	if err != nil {
		t.Fatal(err)
	}
	n := spannerlock.ListScan + 2
	keys := make([]string, n)
	for i := range n {
		keys[i] = fmt.Sprintf("k/%05d", i)
	}
	// Many claims in one go would take minutes on the emulator one
	// transaction at a time; the last two keys are Done.
	far := time.Date(2100, 1, 1, 0, 0, 0, 0, time.UTC)
	var ms []*spanner.Mutation
	for _, k := range keys[:n-2] {
		ms = append(ms, spanner.Insert(b.Table(), []string{"key", "state", "fence", "lease_expiry", "expires_at", "token"},
			[]any{[]byte(k), int64(1), int64(1), far, far, store.NewToken()}))
	}
	if _, err := c.Apply(ctx, ms); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys[n-2:] {
		c := claim(t, b, k, time.Hour)
		if ok, err := b.Complete(ctx, c); !ok || err != nil {
			t.Fatal(ok, err)
		}
	}
	p, err := b.List(ctx, store.ListQuery{Prefix: "k/", State: store.Done, Limit: 5})
	if err != nil || len(p.Records) != 0 || p.Next == "" {
		t.Fatalf("first page of Done rows beyond the scan: %d records, next %q, %v; want empty with a cursor", len(p.Records), p.Next, err)
	}
	got, pages := listAll(t, b, store.ListQuery{Prefix: "k/", State: store.Done, Limit: 5})
	if !slices.Equal(got, keys[n-2:]) || pages != 2 {
		t.Fatalf("Done rows: %q in %d pages; want %q in 2", got, pages, keys[n-2:])
	}
	p, err = b.List(ctx, store.ListQuery{Prefix: "k/", State: store.Claimed, Limit: store.MaxListLimit})
	if err != nil || len(p.Records) != store.MaxListLimit || p.Next == "" {
		t.Fatalf("a full page of claims: %d records, next %q, %v", len(p.Records), p.Next, err)
	}
}
