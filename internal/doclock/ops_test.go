package doclock

import (
	"context"
	"encoding/base64"
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// opStore is a memStore with the operations: records named as the
// backends name them (a test Name: verbatim unless invalid UTF-8 or
// starting with "~"), scanned in byte order or, when utf16 is set, in
// UTF-16 code unit order (as a Java emulator may compare names).
type opStore struct {
	*memStore
	utf16   bool
	slash   bool // Name encodes keys that contain "/", as Firestore's does
	scans   int
	scanned int
	// beforeDelete, when set, runs before a Delete looks at the record.
	beforeDelete func()
	// loseWrites makes Update and Delete apply and then report a lost
	// reply (applied false, lost set, no error), as a retry that met its
	// own write would.
	loseWrites bool
}

func (o *opStore) name(key string) string {
	if utf8.ValidString(key) && !strings.HasPrefix(key, "~") && !(o.slash && strings.Contains(key, "/")) {
		return key
	}
	return "~" + base64.RawURLEncoding.EncodeToString([]byte(key))
}

func (o *opStore) EncodesAll(prefix string) bool { return o.slash && strings.Contains(prefix, "/") }

func (o *opStore) KeyOf(name string) (string, bool) {
	key := name
	if rest, ok := strings.CutPrefix(name, "~"); ok {
		raw, err := base64.RawURLEncoding.DecodeString(rest)
		if err != nil {
			return "", false
		}
		key = string(raw)
	}
	return key, o.name(key) == name
}

func (o *opStore) less(a, b string) bool {
	if !o.utf16 {
		return a < b
	}
	return slices.Compare(utf16.Encode([]rune(a)), utf16.Encode([]rune(b))) < 0
}

func (o *opStore) Update(ctx context.Context, key string, r Record, base int64) (int64, bool, time.Time, error, error) {
	v, applied, at, lost, err := o.memStore.Update(ctx, key, r, base)
	if applied && o.loseWrites {
		return 0, false, at, errors.New("reply lost"), nil
	}
	return v, applied, at, lost, err
}

func (o *opStore) Delete(_ context.Context, key string, base int64) (bool, error, error) {
	if o.beforeDelete != nil {
		o.beforeDelete()
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.calls = append(o.calls, "delete")
	if cur, ok := o.recs[key]; !ok || cur.Version != base {
		return false, nil, nil
	}
	delete(o.recs, key)
	if o.loseWrites {
		return false, errors.New("reply lost"), nil
	}
	return true, nil, nil
}

func (o *opStore) Scan(_ context.Context, rng NameRange, limit int) ([]Row, bool, Reading, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.scans++
	var rows []Row
	for key, r := range o.recs {
		n := o.name(key)
		switch {
		case rng.After != "" && !o.less(rng.After, n),
			rng.After == "" && o.less(n, rng.From),
			rng.To != "" && !o.less(n, rng.To):
			continue
		}
		rows = append(rows, Row{Name: n, Rec: r})
	}
	slices.SortFunc(rows, func(a, b Row) int {
		if o.less(a.Name, b.Name) {
			return -1
		}
		return 1
	})
	done := len(rows) <= limit
	rows = rows[:min(limit, len(rows))]
	o.scanned += len(rows)
	at := o.now()
	return rows, done, Reading{At: at, Recv: at, Exact: true}, nil
}

func newOpLock(now func() time.Time) (*Lock, *opStore) {
	c := NewClock(now)
	o := &opStore{memStore: &memStore{now: now, clock: c, recs: map[string]Record{}}}
	return New("test", time.Hour, c, o), o
}

// listAll follows Next from the start and returns the keys listed, failing
// when a page is above the limit or a call reads more records than it.
func listAll(t *testing.T, l *Lock, o *opStore, q store.ListQuery) []string {
	t.Helper()
	var keys []string
	for range 10000 {
		before := o.scanned
		p, err := l.List(t.Context(), q)
		if err != nil {
			t.Fatalf("list %+v: %v", q, err)
		}
		limit := q.Limit
		if limit == 0 {
			limit = store.DefaultListLimit
		}
		if len(p.Records) > limit || o.scanned-before > limit {
			t.Fatalf("a page of %d records after reading %d, limit %d", len(p.Records), o.scanned-before, limit)
		}
		for _, r := range p.Records {
			keys = append(keys, r.Key)
		}
		if p.Next == "" {
			return keys
		}
		q.Cursor = p.Next
	}
	t.Fatal("the listing does not end")
	return nil
}

// Keys chosen to fall on both sides of every boundary the segments draw:
// verbatim and encoded names, invalid UTF-8, characters around U+D7FF,
// U+FFFF and beyond (where UTF-8 and UTF-16 orders disagree), prefixes
// that end inside a character or a 3-byte group.
var oddKeys = []string{
	"", "a", "ab", "abc", "abcd", "abd", "ac", "b", "~", "~a", "~ab", "~abc", "a~", "a\xff", "ab\xff", "\xff", "\xffa",
	"\xc3", "\xc3\xa9", "\xc3\xa9x", "éa", "\ud7fe", "\ud7ff", "\ud7ffa", "\ue000", "\uffff", "\uffffz", "\U00010000",
	"\U0010ffff", "\U0010ffffa", "z", "zz", "~probe!", "_", "__x__", "x/y", "x/", "x/yz", "x0", "/", "/a", ".",
}

// Following Next lists exactly the keys under the prefix, in the state
// asked, each once, whatever the prefix and whichever order the service
// compares names in, reading no more than the limit per call.
func TestListReportsEachKeyUnderThePrefixOnce(t *testing.T) {
	for _, v := range []struct{ utf16, slash bool }{{false, false}, {true, false}, {false, true}, {true, true}} {
		now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
		l, o := newOpLock(func() time.Time { return now })
		o.utf16, o.slash = v.utf16, v.slash
		ctx := t.Context()
		var keys []string
		for _, k := range oddKeys {
			if k == "" || strings.HasPrefix(o.name(k), "~probe") {
				continue
			}
			keys = append(keys, k)
			r, err := l.Claim(ctx, k, time.Minute)
			if err != nil || r.Outcome != store.Won {
				t.Fatalf("claim %q: %v %v", k, r.Outcome, err)
			}
			if len(keys)%2 == 0 {
				if ok, err := l.Complete(ctx, r.Claim); !ok || err != nil {
					t.Fatalf("complete %q: %v %v", k, ok, err)
				}
			}
		}
		rng := rand.New(rand.NewPCG(1, 2))
		prefixes := append([]string{}, oddKeys...)
		for _, k := range oddKeys {
			for i := range len(k) {
				prefixes = append(prefixes, k[:i])
			}
		}
		for _, p := range prefixes {
			for _, state := range []store.State{0, store.Claimed, store.Done} {
				var want []string
				for i, k := range keys {
					st := store.Claimed
					if (i+1)%2 == 0 {
						st = store.Done
					}
					if strings.HasPrefix(k, p) && (state == 0 || st == state) {
						want = append(want, k)
					}
				}
				q := store.ListQuery{Prefix: p, State: state, Limit: 1 + rng.IntN(4)}
				got := listAll(t, l, o, q)
				slices.Sort(got)
				slices.Sort(want)
				if !slices.Equal(got, want) {
					t.Errorf("%+v, prefix %q, state %v, limit %d: listed %q, want %q", v, p, state, q.Limit, got, want)
				}
			}
		}
	}
}

// List reports a record as stored, with the version of its token and the
// read's time, and changes nothing (an expired record stays).
func TestListAndInspectReportTheRecordAsStored(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l, o := newOpLock(func() time.Time { return now })
	ctx := t.Context()
	c, _ := l.Claim(ctx, "k", time.Minute)
	now = now.Add(3 * time.Hour) // lease and ttl both passed
	before := o.recs["k"]
	got, found, err := l.Inspect(ctx, "k")
	if err != nil || !found {
		t.Fatalf("inspect: %v %v", found, err)
	}
	want := store.Record{Key: "k", State: store.Claimed, Fence: 1, LeaseExpiry: c.Claim.LeaseExpiry, ExpiresAt: before.Exp,
		Version: store.VersionOf(c.Claim.Token), Now: now}
	if got != want {
		t.Fatalf("inspect: %+v, want %+v", got, want)
	}
	p, err := l.List(ctx, store.ListQuery{})
	if err != nil || len(p.Records) != 1 || p.Records[0] != want || p.Next != "" {
		t.Fatalf("list: %+v %v, want one record %+v", p, err, want)
	}
	if o.recs["k"] != before {
		t.Fatalf("the record changed: %+v, was %+v", o.recs["k"], before)
	}
	if _, found, err := l.Inspect(ctx, "none"); found || err != nil {
		t.Fatalf("inspect of an absent key: %v %v", found, err)
	}
}

// A cursor is refused, before any read, for another prefix or state, and
// when it was not issued by List at all.
func TestListRefusesAForeignCursor(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l, o := newOpLock(func() time.Time { return now })
	ctx := t.Context()
	for _, k := range []string{"a1", "a2", "a3"} {
		l.Claim(ctx, k, time.Minute)
	}
	p, err := l.List(ctx, store.ListQuery{Prefix: "a", Limit: 1})
	if err != nil || p.Next == "" {
		t.Fatalf("first page: %+v %v", p, err)
	}
	scans := o.scans
	for _, q := range []store.ListQuery{
		{Prefix: "b", Cursor: p.Next},
		{Prefix: "a", State: store.Done, Cursor: p.Next},
		{Prefix: "a", Cursor: "a1"},
		{Prefix: "a", Cursor: p.Next + "!"},
		{Prefix: "a", Cursor: p.Next[:len(cursorTag)]},
		{Prefix: "a", Cursor: cursorTag + base64.RawURLEncoding.EncodeToString(append(l.queryID(store.ListQuery{Prefix: "a"}), 7))},
		{Prefix: "a", Limit: -1},
	} {
		if _, err := l.List(ctx, q); !errors.Is(err, store.ErrInvalidQuery) {
			t.Errorf("list %+v: %v, want ErrInvalidQuery", q, err)
		}
	}
	if o.scans != scans {
		t.Fatalf("%d scans for refused queries", o.scans-scans)
	}
}

// ForceRelease does what Release does to a claim that the record still
// holds, live or lapsed, and refuses one that changed; Forget deletes only
// a Done record that has not changed.
func TestForceReleaseAndForgetActOnlyOnTheRecordRead(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l, o := newOpLock(func() time.Time { return now })
	ctx := t.Context()
	c, _ := l.Claim(ctx, "k", time.Minute)
	r, _, _ := l.Inspect(ctx, "k")
	if ok, err := l.Forget(ctx, r); ok || err != nil {
		t.Fatalf("forget of a claim: %v %v", ok, err)
	}
	stale := r
	stale.Version = store.VersionOf("another token")
	if ok, err := l.ForceRelease(ctx, stale); ok || err != nil {
		t.Fatalf("force-release of another version: %v %v", ok, err)
	}
	now = now.Add(10 * time.Second)
	if ok, err := l.ForceRelease(ctx, r); !ok || err != nil {
		t.Fatalf("force-release: %v %v", ok, err)
	}
	got := o.recs["k"]
	if got.Fence != 2 || got.Token != c.Claim.Token || !got.Lease.Equal(now) || !got.Exp.Equal(now.Add(time.Hour)) || got.State != StateClaimed {
		t.Fatalf("after force-release: %+v, want fence 2, the same token, lease %v", got, now)
	}
	if ok, err := l.ForceRelease(ctx, r); ok || err != nil {
		t.Fatalf("second force-release: %v %v", ok, err)
	}
	if ok, _ := l.Complete(ctx, c.Claim); ok {
		t.Fatal("the old holder completed after a force-release")
	}
	next, _ := l.Claim(ctx, "k", time.Minute)
	if next.Outcome != store.Won || next.Claim.Fence != 3 {
		t.Fatalf("claim after force-release: %v fence %d", next.Outcome, next.Claim.Fence)
	}
	l.Complete(ctx, next.Claim)
	done, _, _ := l.Inspect(ctx, "k")
	if ok, err := l.ForceRelease(ctx, done); ok || err != nil {
		t.Fatalf("force-release of a Done record: %v %v", ok, err)
	}
	// The record is forgotten and claimed afresh between Forget's read
	// and its delete: the new record is left alone.
	o.beforeDelete = func() {
		o.beforeDelete = nil
		o.mu.Lock()
		delete(o.recs, "k")
		o.mu.Unlock()
		l.Claim(ctx, "k", time.Minute)
	}
	if ok, err := l.Forget(ctx, done); ok || err != nil {
		t.Fatalf("forget of a record recreated since: %v %v", ok, err)
	}
	if cur, ok := o.recs["k"]; !ok || cur.State != StateClaimed || cur.Fence != 1 {
		t.Fatalf("the recreated record: %+v %v", cur, ok)
	}
	again, _, _ := l.Inspect(ctx, "k")
	l.ForceRelease(ctx, again)
	fresh, _ := l.Claim(ctx, "k", time.Minute)
	l.Complete(ctx, fresh.Claim)
	d, _, _ := l.Inspect(ctx, "k")
	if ok, err := l.Forget(ctx, d); !ok || err != nil {
		t.Fatalf("forget: %v %v", ok, err)
	}
	if _, ok := o.recs["k"]; ok {
		t.Fatal("the record stayed")
	}
	if ok, err := l.Forget(ctx, d); ok || err != nil {
		t.Fatalf("second forget: %v %v", ok, err)
	}
}

// After a lost reply, ForceRelease and Forget answer false, never true: a
// write the service did not report applied is not counted.
func TestALostReplyIsNeverReportedAsDone(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l, o := newOpLock(func() time.Time { return now })
	ctx := t.Context()
	l.Claim(ctx, "k", time.Minute)
	r, _, _ := l.Inspect(ctx, "k")
	o.loseWrites = true
	if ok, err := l.ForceRelease(ctx, r); ok || err != nil {
		t.Fatalf("force-release with a lost reply: %v %v, want false", ok, err)
	}
	if got := o.recs["k"]; got.Fence != 2 {
		t.Fatalf("the release did not apply: %+v", got)
	}
	o.loseWrites = false
	c, _ := l.Claim(ctx, "k", time.Minute)
	l.Complete(ctx, c.Claim)
	d, _, _ := l.Inspect(ctx, "k")
	o.loseWrites = true
	if ok, err := l.Forget(ctx, d); ok || err != nil {
		t.Fatalf("forget with a lost reply: %v %v, want false", ok, err)
	}
	if _, ok := o.recs["k"]; ok {
		t.Fatal("the delete did not apply")
	}
}

// ForceRelease and Forget validate the record before any request.
func TestOpsValidateBeforeAnyRequest(t *testing.T) {
	l, o := newOpLock(time.Now)
	ctx := t.Context()
	for _, r := range []store.Record{{Key: "", Fence: 1, Version: "v"}, {Key: "k", Fence: 0, Version: "v"}, {Key: "k", Fence: 1}} {
		if _, err := l.ForceRelease(ctx, r); !errors.Is(err, store.ErrInvalidRecord) {
			t.Errorf("force-release %+v: %v", r, err)
		}
		if _, err := l.Forget(ctx, r); !errors.Is(err, store.ErrInvalidRecord) {
			t.Errorf("forget %+v: %v", r, err)
		}
	}
	if _, _, err := l.Inspect(ctx, ""); !errors.Is(err, store.ErrInvalidKey) {
		t.Errorf("inspect of an empty key: %v", err)
	}
	if calls := o.take(); len(calls) != 0 {
		t.Fatalf("requests sent: %v", calls)
	}
}

// A cursor List did not issue, however forged (truncated, bit-flipped,
// with the right digest and any segment and name), is refused with
// ErrInvalidQuery or continues the listing within the prefix: never a
// panic, never a record outside the prefix, never a page above the limit.
func FuzzListCursor(f *testing.F) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l, o := newOpLock(func() time.Time { return now })
	for _, k := range []string{"a", "ab", "abc", "a\xff", "~a", "b", "a/b", "\ud7ff", "abcd"} {
		if r, err := l.Claim(context.Background(), k, time.Minute); err != nil || r.Outcome != store.Won {
			f.Fatalf("claim %q: %v %v", k, r.Outcome, err)
		}
	}
	for _, p := range []string{"", "a", "ab", "~", "a\xff"} {
		q := store.ListQuery{Prefix: p, Limit: 1}
		for {
			page, err := l.List(context.Background(), q)
			if err != nil {
				f.Fatal(err)
			}
			if page.Next == "" {
				break
			}
			f.Add(p, page.Next)
			q.Cursor = page.Next
		}
		id := l.queryID(store.ListQuery{Prefix: p})
		for _, seg := range []byte{0, 1, 2, 255} {
			f.Add(p, cursorTag+base64.RawURLEncoding.EncodeToString(append(append(append([]byte{}, id...), seg), "zz"...)))
		}
	}
	f.Add("a", cursorTag)
	f.Add("a", "c1")
	f.Fuzz(func(t *testing.T, prefix, cursor string) {
		q := store.ListQuery{Prefix: prefix, Cursor: cursor, Limit: 2}
		if store.ValidateQuery(q) != nil {
			return
		}
		before := o.scanned
		page, err := l.List(context.Background(), q)
		if err != nil {
			if !errors.Is(err, store.ErrInvalidQuery) {
				t.Fatalf("list %+v: %v, want nil or ErrInvalidQuery", q, err)
			}
			return
		}
		if len(page.Records) > 2 || o.scanned-before > 2 {
			t.Fatalf("list %+v: %d records after reading %d, limit 2", q, len(page.Records), o.scanned-before)
		}
		for _, r := range page.Records {
			if !strings.HasPrefix(r.Key, prefix) {
				t.Fatalf("list %+v: key %q is outside the prefix", q, r.Key)
			}
		}
	})
}
