package enginetest

import (
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// The operations (store.Operator) on every engine: what the storetest
// RunOps cases check, and what is particular to SQL (keys compared as
// bytes, the window's bound, the read-then-conditional-write of
// ForceRelease and Forget).

// setColumn sets one integer column of key's row directly, as time passing
// would (the tests never sleep).
func setColumn(t *testing.T, e engine, db *sql.DB, b *sqllock.Backend, key, column string, v int64) {
	t.Helper()
	q := "UPDATE " + tableOf(b) + " SET " + column + " = ? WHERE idem_key = ?"
	if e.name == "postgres" {
		q = "UPDATE " + tableOf(b) + " SET " + column + " = $1 WHERE idem_key = $2"
	}
	if _, err := db.Exec(q, v, []byte(key)); err != nil {
		t.Fatal(err)
	}
}

func mustInspect(t *testing.T, b *sqllock.Backend, key string) store.Record {
	t.Helper()
	r, ok, err := b.Inspect(t.Context(), key)
	if err != nil || !ok {
		t.Fatalf("inspect %q: found %v, %v", key, ok, err)
	}
	return r
}

func winHour(t *testing.T, b *sqllock.Backend, key string) store.Claim {
	t.Helper()
	r, err := b.Claim(t.Context(), key, time.Hour)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim %q: %v, %v", key, r.Outcome, err)
	}
	return r.Claim
}

func TestOpsInspectReportsTheRecordAsStoredWithoutTheToken(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil, sqllock.WithTTL(time.Hour))
		ctx := t.Context()
		if r, ok, err := b.Inspect(ctx, "absent"); err != nil || ok || r != (store.Record{}) {
			t.Fatalf("inspect of an absent key: %+v %v %v", r, ok, err)
		}
		c := winHour(t, b, "k")
		r := mustInspect(t, b, "k")
		if r.Key != "k" || r.State != store.Claimed || r.Fence != 1 || !r.LeaseExpiry.Equal(c.LeaseExpiry) ||
			r.Version != store.VersionOf(c.Token) || r.Fingerprint != "" || r.Reclaimable() {
			t.Fatalf("claimed record %+v, claim %+v", r, c)
		}
		if !r.ExpiresAt.Equal(c.LeaseExpiry.Add(time.Hour)) {
			t.Fatalf("expires at %v, want lease expiry + ttl %v", r.ExpiresAt, c.LeaseExpiry.Add(time.Hour))
		}
		if d := r.LeaseExpiry.Sub(r.Now); d <= 0 || d > time.Hour {
			t.Fatalf("now %v is not within the hour's lease ending %v", r.Now, r.LeaseExpiry)
		}
		if ok, err := b.CompleteFingerprint(ctx, c, "fp-1"); !ok || err != nil {
			t.Fatalf("complete: %v %v", ok, err)
		}
		r = mustInspect(t, b, "k")
		if r.State != store.Done || r.Fence != 1 || r.Fingerprint != "fp-1" || r.Version != store.VersionOf(c.Token) || r.Reclaimable() {
			t.Fatalf("done record %+v", r)
		}
		if d := r.ExpiresAt.Sub(r.Now); d <= 0 || d > time.Hour {
			t.Fatalf("now %v is not within the hour's ttl ending %v", r.Now, r.ExpiresAt)
		}
		// Expired, and still reported as stored: no lazy deletion.
		setColumn(t, e, db, b, "k", "expires_at_ms", 1)
		for range 2 {
			r = mustInspect(t, b, "k")
			if r.State != store.Done || r.Fence != 1 || r.ExpiresAt.UnixMilli() != 1 || !r.Reclaimable() {
				t.Fatalf("expired done record %+v", r)
			}
		}
		page, err := b.List(ctx, store.ListQuery{})
		if err != nil || len(page.Records) != 1 || page.Records[0].Key != "k" || !page.Records[0].Reclaimable() {
			t.Fatalf("list of the expired record: %+v %v", page, err)
		}
		// The next Claim finds it where Inspect left it: fence 2.
		if c2 := winHour(t, b, "k"); c2.Fence != 2 {
			t.Fatalf("claim after the reads: fence %d, want 2", c2.Fence)
		}
	})
}

func TestOpsForceReleaseFencesTheOldHolderOut(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil, sqllock.WithTTL(time.Hour))
		ctx := t.Context()
		c := winHour(t, b, "k")
		r := mustInspect(t, b, "k")
		for _, stale := range []store.Record{
			{Key: "k", Fence: 2, Version: r.Version},
			{Key: "k", Fence: 1, Version: store.VersionOf("another token")},
			{Key: "absent", Fence: 1, Version: r.Version},
		} {
			if ok, err := b.ForceRelease(ctx, stale); ok || err != nil {
				t.Fatalf("force-release of %+v: %v %v", stale, ok, err)
			}
		}
		if now := mustInspect(t, b, "k"); now.Fence != 1 || !now.LeaseExpiry.Equal(c.LeaseExpiry) {
			t.Fatalf("a refused force-release changed the record: %+v", now)
		}
		if ok, err := b.ForceRelease(ctx, r); !ok || err != nil {
			t.Fatalf("force-release: %v %v", ok, err)
		}
		after := mustInspect(t, b, "k")
		if after.State != store.Claimed || after.Fence != 2 || after.Version != r.Version || !after.Reclaimable() ||
			after.LeaseExpiry.After(after.Now) || after.LeaseExpiry.Before(r.Now) {
			t.Fatalf("released record %+v, read before %+v", after, r)
		}
		// As Release does: expires at the release time + ttl.
		if !after.ExpiresAt.Equal(after.LeaseExpiry.Add(time.Hour)) {
			t.Fatalf("released record expires at %v, want %v", after.ExpiresAt, after.LeaseExpiry.Add(time.Hour))
		}
		if ok, err := b.ForceRelease(ctx, r); ok || err != nil {
			t.Fatalf("second force-release of the same read: %v %v", ok, err)
		}
		if ok, err := b.Complete(ctx, c); ok || err != nil {
			t.Fatalf("the old holder's complete after a force-release: %v %v", ok, err)
		}
		if _, err := b.Extend(ctx, c, time.Hour); !errors.Is(err, store.ErrLost) {
			t.Fatalf("the old holder's extend after a force-release: %v", err)
		}
		c3 := winHour(t, b, "k")
		if c3.Fence != 3 {
			t.Fatalf("the next claim won fence %d, want 3", c3.Fence)
		}
		// A lapsed lease is released too; a Done record never.
		setColumn(t, e, db, b, "k", "lease_expiry_ms", 1)
		lapsed := mustInspect(t, b, "k")
		if !lapsed.Reclaimable() {
			t.Fatalf("lapsed %+v", lapsed)
		}
		if ok, err := b.ForceRelease(ctx, lapsed); !ok || err != nil {
			t.Fatalf("force-release of a lapsed lease: %v %v", ok, err)
		}
		c5 := winHour(t, b, "k")
		if ok, err := b.Complete(ctx, c5); !ok || err != nil {
			t.Fatal(ok, err)
		}
		done := mustInspect(t, b, "k")
		if ok, err := b.ForceRelease(ctx, done); ok || err != nil {
			t.Fatalf("force-release of a done record: %v %v", ok, err)
		}
		if now := mustInspect(t, b, "k"); now.State != store.Done || now.Fence != done.Fence {
			t.Fatalf("force-release changed a done record: %+v", now)
		}
	})
}

func TestOpsForgetDeletesOnlyTheDoneRecordItRead(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		_, b := e.fresh(t, nil, sqllock.WithTTL(time.Hour))
		ctx := t.Context()
		c := winHour(t, b, "k")
		claimed := mustInspect(t, b, "k")
		if ok, err := b.Forget(ctx, claimed); ok || err != nil {
			t.Fatalf("forget of a live claim: %v %v", ok, err)
		}
		if ok, err := b.Complete(ctx, c); !ok || err != nil {
			t.Fatal(ok, err)
		}
		done := mustInspect(t, b, "k")
		for _, stale := range []store.Record{
			{Key: "k", Fence: 2, Version: done.Version},
			{Key: "k", Fence: 1, Version: store.VersionOf("another token")},
		} {
			if ok, err := b.Forget(ctx, stale); ok || err != nil {
				t.Fatalf("forget of %+v: %v %v", stale, ok, err)
			}
		}
		if ok, err := b.Forget(ctx, done); !ok || err != nil {
			t.Fatalf("forget: %v %v", ok, err)
		}
		if r, ok, err := b.Inspect(ctx, "k"); ok || err != nil {
			t.Fatalf("after forget: %+v %v %v", r, ok, err)
		}
		if ok, err := b.Forget(ctx, done); ok || err != nil {
			t.Fatalf("forget of a gone record: %v %v", ok, err)
		}
		// Recreated since the read: fence 1 and Done again, another token.
		c2 := winHour(t, b, "k")
		if c2.Fence != 1 {
			t.Fatalf("fence %d after forget, want 1", c2.Fence)
		}
		if ok, err := b.Complete(ctx, c); ok || err != nil {
			t.Fatalf("the forgotten holder completes the new record: %v %v", ok, err)
		}
		if ok, err := b.Complete(ctx, c2); !ok || err != nil {
			t.Fatal(ok, err)
		}
		if ok, err := b.Forget(ctx, done); ok || err != nil {
			t.Fatalf("forget of a record recreated since the read: %v %v", ok, err)
		}
		if r := mustInspect(t, b, "k"); r.Version != store.VersionOf(c2.Token) || r.State != store.Done {
			t.Fatalf("recreated record %+v", r)
		}
	})
}

// ForceRelease and the holder's Complete race on the same fence: exactly
// one of them wins, and the record says which.
func TestOpsForceReleaseRacingCompleteOneWins(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		_, b := e.fresh(t, nil, sqllock.WithTTL(time.Hour))
		ctx := t.Context()
		for i := range 20 {
			key := fmt.Sprint("race-", i)
			c := winHour(t, b, key)
			r := mustInspect(t, b, key)
			var released, completed bool
			var errR, errC error
			var wg sync.WaitGroup
			wg.Go(func() { released, errR = b.ForceRelease(ctx, r) })
			wg.Go(func() { completed, errC = b.Complete(ctx, c) })
			wg.Wait()
			if errR != nil || errC != nil || released == completed {
				t.Fatalf("round %d: released %v (%v), completed %v (%v): want exactly one", i, released, errR, completed, errC)
			}
			now := mustInspect(t, b, key)
			if completed && (now.State != store.Done || now.Fence != 1) || released && (now.State != store.Claimed || now.Fence != 2) {
				t.Fatalf("round %d: released %v, completed %v, record %+v", i, released, completed, now)
			}
		}
	})
}

// Keys that a LIKE pattern or a collation would get wrong: pattern
// characters, a backslash, multibyte UTF-8, invalid UTF-8 and 0xFF bytes
// (the prefix's upper bound drops trailing 0xFF bytes), case, and
// trailing spaces and control bytes (which a PAD SPACE comparison would
// order as if "a" were "a ").
var listKeys = []string{
	"a ", "a  ", "a\x01", "a\x1f", "a \x01", "\x01", "\x7f", "\x80", "A", "a", "a%", "a%b", "a_", "a_b", "a\\", "a\\b", "a\\%", "aa", "aB", "ab",
	"a\xff", "a\xff\xff", "a\xff\x01", "a\xffb", "b", "é", "éa", "e\u0301", "鍵", "鍵🔑",
	"\xff", "\xff\xff", "\xff\x01", "\xff\xff\xff", strings.Repeat("z", store.MaxKeyLen),
}

var listPrefixes = []string{"", "a", "a ", "a%", "a_", "a\\", "A", "é", "\xc3", "鍵", "\xff", "\xff\xff", "a\xff", "zz", "\x01", "z"}

func TestOpsListPagesEveryKeyOnceInByteOrderByPrefixAndState(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		c := &counter{}
		_, b := e.fresh(t, c, sqllock.WithTTL(time.Hour))
		ctx := t.Context()
		state := map[string]store.State{}
		for i, k := range listKeys {
			cl := winHour(t, b, k)
			state[k] = store.Claimed
			if i%2 == 0 {
				if ok, err := b.Complete(ctx, cl); !ok || err != nil {
					t.Fatal(ok, err)
				}
				state[k] = store.Done
			}
		}
		sorted := slices.Clone(listKeys)
		slices.Sort(sorted) // Go compares strings byte by byte
		for _, prefix := range listPrefixes {
			for _, st := range []store.State{0, store.Claimed, store.Done} {
				var want []string
				for _, k := range sorted {
					if strings.HasPrefix(k, prefix) && (st == 0 || state[k] == st) {
						want = append(want, k)
					}
				}
				under := 0
				for _, k := range sorted {
					if strings.HasPrefix(k, prefix) {
						under++
					}
				}
				for _, limit := range []int{1, 2, 3, 0, store.MaxListLimit} {
					q := store.ListQuery{Prefix: prefix, State: st, Limit: limit}
					per := limit
					if per == 0 {
						per = store.DefaultListLimit
					}
					var got []string
					calls := 0
					for {
						before := c.n.Load()
						page, err := b.List(ctx, q)
						if err != nil {
							t.Fatalf("%+v: %v", q, err)
						}
						if n := c.n.Load() - before; n != 1 {
							t.Fatalf("%+v: a page took %d statements, want 1", q, n)
						}
						calls++
						if len(page.Records) > per {
							t.Fatalf("%+v: %d records in a page", q, len(page.Records))
						}
						for _, r := range page.Records {
							if r.State != state[r.Key] || r.Fence != 1 || r.Now.IsZero() {
								t.Fatalf("%+v: record %+v, stored state %v", q, r, state[r.Key])
							}
							got = append(got, r.Key)
						}
						if page.Next == "" {
							break
						}
						q.Cursor = page.Next
					}
					if !slices.Equal(got, want) {
						t.Fatalf("prefix %q state %v limit %d: listed %q, want %q", prefix, st, limit, got, want)
					}
					// Each call reads up to per keys of the prefix's range:
					// the listing ends after at most under/per + 1 calls.
					if calls > under/per+1 {
						t.Fatalf("prefix %q state %v limit %d: %d calls for %d keys under the prefix", prefix, st, limit, calls, under)
					}
				}
			}
		}
	})
}

// A page filtered by state reads at most its limit of records, whatever
// the filter selects: over many records in the other state it comes back
// short (here empty) with Next set, and the listing goes on from there.
func TestOpsListReadsABoundedWindowWhateverTheStateFilter(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		_, b := e.fresh(t, nil, sqllock.WithTTL(time.Hour))
		ctx := t.Context()
		for i := range 10 {
			winHour(t, b, fmt.Sprintf("k%02d", i))
		}
		c := winHour(t, b, "k10")
		if ok, err := b.Complete(ctx, c); !ok || err != nil {
			t.Fatal(ok, err)
		}
		q := store.ListQuery{Prefix: "k", State: store.Done, Limit: 4}
		var pages [][]string
		for {
			page, err := b.List(ctx, q)
			if err != nil {
				t.Fatal(err)
			}
			var keys []string
			for _, r := range page.Records {
				keys = append(keys, r.Key)
			}
			pages = append(pages, keys)
			if page.Next == "" {
				break
			}
			q.Cursor = page.Next
		}
		want := [][]string{nil, nil, {"k10"}}
		if fmt.Sprint(pages) != fmt.Sprint(want) {
			t.Fatalf("pages %q, want %q", pages, want)
		}
	})
}

func TestOpsRefuseBadArgumentsBeforeAnyIO(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		c := &counter{}
		_, b := e.fresh(t, c, sqllock.WithTTL(time.Hour))
		_, other := e.fresh(t, nil, sqllock.WithTTL(time.Hour))
		ctx := t.Context()
		for _, k := range []string{"a", "ab", "ac"} {
			winHour(t, b, k)
			winHour(t, other, k)
		}
		page, err := b.List(ctx, store.ListQuery{Prefix: "a", Limit: 1})
		if err != nil || page.Next == "" {
			t.Fatalf("first page: %+v %v", page, err)
		}
		otherPage, err := other.List(ctx, store.ListQuery{Prefix: "a", Limit: 1})
		if err != nil || otherPage.Next == "" {
			t.Fatalf("other's first page: %+v %v", otherPage, err)
		}
		before := c.n.Load() + c.prepares.Load()
		for _, q := range []store.ListQuery{
			{Prefix: "ab", Cursor: page.Next},
			{Prefix: "a", State: store.Claimed, Cursor: page.Next},
			{Prefix: "", Cursor: page.Next},
			{Prefix: "a", Cursor: otherPage.Next}, // another table's
			{Prefix: "a", Cursor: "!!"},
			{Prefix: "a", Cursor: page.Next[:len(page.Next)-1]},
			{Prefix: "a", Cursor: "AQ"},
			{Prefix: "a", Limit: -1},
			{Prefix: "a", Limit: store.MaxListLimit + 1},
			{Prefix: "a\x00"},
			{State: 3},
		} {
			if _, err := b.List(ctx, q); !errors.Is(err, store.ErrInvalidQuery) {
				t.Errorf("list %+v: %v, want ErrInvalidQuery", q, err)
			}
		}
		for _, r := range []store.Record{{Key: "", Fence: 1, Version: "v"}, {Key: "a", Fence: 0, Version: "v"}, {Key: "a", Fence: 1}} {
			if _, err := b.ForceRelease(ctx, r); !errors.Is(err, store.ErrInvalidRecord) {
				t.Errorf("force-release %+v: %v", r, err)
			}
			if _, err := b.Forget(ctx, r); !errors.Is(err, store.ErrInvalidRecord) {
				t.Errorf("forget %+v: %v", r, err)
			}
		}
		if _, _, err := b.Inspect(ctx, "a\x00"); !errors.Is(err, store.ErrInvalidKey) {
			t.Errorf("inspect of a NUL key: %v", err)
		}
		if n := c.n.Load() + c.prepares.Load() - before; n != 0 {
			t.Fatalf("%d statements sent for refused arguments", n)
		}
		// The cursor still works for its own query.
		next, err := b.List(ctx, store.ListQuery{Prefix: "a", Limit: 1, Cursor: page.Next})
		if err != nil || len(next.Records) != 1 || next.Records[0].Key != "ab" {
			t.Fatalf("second page: %+v %v", next, err)
		}
	})
}

// The reads' now is the database's, as Claim's: on a server whose clock
// runs two hours ahead of this machine's, Inspect and List report the
// server's time, and a lease the server judges live.
func TestOpsNowIsTheServersClock(t *testing.T) {
	eachEngine(t, networked, func(t *testing.T, e engine) {
		jh := jumpHarness(e)(t)
		b := jh.Backend.(*sqllock.Backend)
		ctx := t.Context()
		jh.Jump(2 * time.Hour)
		c := winHour(t, b, "k")
		r := mustInspect(t, b, "k")
		if d := r.Now.Sub(jh.Now()); d < -time.Minute || d > time.Minute {
			t.Fatalf("inspect's now %v, the server's clock %v", r.Now, jh.Now())
		}
		if r.Reclaimable() || !r.LeaseExpiry.Equal(c.LeaseExpiry) {
			t.Fatalf("record %+v, claim %+v", r, c)
		}
		page, err := b.List(ctx, store.ListQuery{})
		if err != nil || len(page.Records) != 1 {
			t.Fatal(page, err)
		}
		if d := page.Records[0].Now.Sub(jh.Now()); d < -time.Minute || d > time.Minute {
			t.Fatalf("list's now %v, the server's clock %v", page.Records[0].Now, jh.Now())
		}
		if time.Since(r.Now) > -time.Hour {
			t.Fatalf("inspect's now %v is this machine's, not the server's", r.Now)
		}
	})
}

// The conditional write of ForceRelease and Forget lands but its reply is
// lost: the retry reads the record moved on and answers false, never a
// second release, and never true for a write it cannot see.
func TestOpsWriteWhoseReplyWasLostIsNotRepeated(t *testing.T) {
	c := &counter{}
	_, b := sqliteEngine.fresh(t, c, sqllock.WithTTL(time.Hour))
	ctx := t.Context()
	cl := winHour(t, b, "k")
	r := mustInspect(t, b, "k")
	c.loseExecReply.Store(true)
	if ok, err := b.ForceRelease(ctx, r); ok || err != nil {
		t.Fatalf("force-release whose reply was lost: %v %v; want false, nil (it may not know)", ok, err)
	}
	if c.loseExecReply.Load() {
		t.Fatal("no exec's reply was lost")
	}
	if got := mustInspect(t, b, "k"); got.Fence != 2 || !got.Reclaimable() {
		t.Fatalf("after the lost reply: %+v, want released once (fence 2)", got)
	}
	if ok, err := b.Complete(ctx, cl); ok || err != nil {
		t.Fatalf("the old holder completes after the release: %v %v", ok, err)
	}
	d := winHour(t, b, "d")
	if ok, err := b.Complete(ctx, d); !ok || err != nil {
		t.Fatal(ok, err)
	}
	dr := mustInspect(t, b, "d")
	c.loseExecReply.Store(true)
	if ok, err := b.Forget(ctx, dr); ok || err != nil {
		t.Fatalf("forget whose reply was lost: %v %v; want false, nil", ok, err)
	}
	if c.loseExecReply.Load() {
		t.Fatal("no exec's reply was lost")
	}
	if got, ok, err := b.Inspect(ctx, "d"); ok || err != nil {
		t.Fatalf("after the lost reply: %+v %v %v, want no record", got, ok, err)
	}
}

// go-sql-driver/mysql reports changed rows, or with clientFoundRows
// matched rows: ForceRelease and Forget change every row they match (the
// fence rises; the row goes), so they answer the same either way.
func TestOpsMariaDBAnswerAlikeWithClientFoundRows(t *testing.T) {
	for _, found := range []bool{false, true} {
		t.Run(fmt.Sprint("clientFoundRows=", found), func(t *testing.T) {
			db := mariadb.open(t, mariadb.dsn(t)+fmt.Sprint("?clientFoundRows=", found), nil)
			b := mariadb.backend(t, db, sqllock.WithTTL(time.Hour))
			ctx := t.Context()
			winHour(t, b, "k")
			r := mustInspect(t, b, "k")
			if ok, err := b.ForceRelease(ctx, r); !ok || err != nil {
				t.Fatalf("force-release: %v %v", ok, err)
			}
			if ok, err := b.ForceRelease(ctx, r); ok || err != nil {
				t.Fatalf("force-release again: %v %v", ok, err)
			}
			c := winHour(t, b, "k")
			if ok, err := b.Complete(ctx, c); !ok || err != nil {
				t.Fatal(ok, err)
			}
			done := mustInspect(t, b, "k")
			if ok, err := b.Forget(ctx, done); !ok || err != nil {
				t.Fatalf("forget: %v %v", ok, err)
			}
			if ok, err := b.Forget(ctx, done); ok || err != nil {
				t.Fatalf("forget again: %v %v", ok, err)
			}
		})
	}
}
