package doclocktest

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Keys stored verbatim and encoded (see Name), around every boundary the
// listing draws on entity names and document IDs: "/", "." and "..",
// "~", invalid UTF-8, a
// prefix ending inside a character, characters where UTF-8 and UTF-16
// orders disagree.
var listKeys = []string{
	"a", "a.", "a.b", "a/", "a/b", "a0", "ab", "abc", "abcd", "a~", "a\xff", ".", "..", ".a", "..b", "/", "/x", "~", "~a", "~abc",
	"\xc3\xa9", "\xc3\xa9x", "\xff", "__x__", "__x", "\ud7ff", "\ue000", "\uffff", "\U00010000", "z",
}

// Following Next lists exactly the keys under each prefix, each once, on
// the emulator, whatever the prefix: every key above and every prefix of
// one.
func listOnTheEmulatorCoversEveryKindOfName(t *testing.T, drv h) {
	drv.Emulator(t)
	b, _ := drv.New(t, Config{})
	ctx := t.Context()
	for _, k := range listKeys {
		if r, err := b.Claim(ctx, k, time.Minute); err != nil || r.Outcome != store.Won {
			t.Fatalf("claim %q: %v %v", k, r.Outcome, err)
		}
	}
	prefixes := []string{""}
	for _, k := range listKeys {
		for i := 1; i <= len(k); i++ {
			if !slices.Contains(prefixes, k[:i]) {
				prefixes = append(prefixes, k[:i])
			}
		}
	}
	for _, p := range prefixes {
		var want, got []string
		for _, k := range listKeys {
			if strings.HasPrefix(k, p) {
				want = append(want, k)
			}
		}
		q := store.ListQuery{Prefix: p, Limit: 3}
		for pages := 0; ; pages++ {
			if pages > 100 {
				t.Fatalf("prefix %q: no end after %d pages", p, pages)
			}
			page, err := b.List(ctx, q)
			if err != nil {
				t.Fatalf("list %q: %v", p, err)
			}
			for _, r := range page.Records {
				got = append(got, r.Key)
			}
			if q.Cursor = page.Next; q.Cursor == "" {
				break
			}
		}
		slices.Sort(want)
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("prefix %q: listed %q, want %q", p, got, want)
		}
	}
}

// doneRecord claims and completes key on b and returns the record as
// Inspect reads it.
func doneRecord(t *testing.T, b store.Operator, key string) store.Record {
	t.Helper()
	ctx := t.Context()
	c, err := b.Claim(ctx, key, time.Minute)
	if err != nil || c.Outcome != store.Won {
		t.Fatalf("claim %q: %v %v", key, c.Outcome, err)
	}
	if ok, err := b.Complete(ctx, c.Claim); !ok || err != nil {
		t.Fatalf("complete %q: %v %v", key, ok, err)
	}
	r, found, err := b.Inspect(ctx, key)
	if err != nil || !found {
		t.Fatalf("inspect %q: %v %v", key, found, err)
	}
	return r
}

// Two Forget calls of one record race: the first reads it, its delete is
// held back, the second deletes the record meanwhile, and then the first's
// delete reaches the emulator (a retry after an Unavailable). Only the
// second deleted: the first MUST NOT report true too.
func forgetRacedByAnotherForgetReportsTrueOnce(t *testing.T, drv h) {
	drv.Emulator(t)
	a, ra, b, _ := drv.twoOnOneClock(t)
	ctx := t.Context()
	r := doneRecord(t, a, "k")
	var okB bool
	var errB error
	ra.WhileLost = func() { okB, errB = b.Forget(ctx, r) }
	ra.DropNextCommit.Store(true)
	okA, errA := a.Forget(ctx, r)
	if errB != nil || !okB {
		t.Fatalf("the second forget: %v %v, want true", okB, errB)
	}
	if okA {
		t.Fatalf("the first forget reported true (%v), but the second had deleted the record before its delete arrived", errA)
	}
	if cur, found, err := b.Inspect(ctx, "k"); err != nil || found {
		t.Fatalf("after the race: %+v %v %v, want no record", cur, found, err)
	}
}

// The same with a record that a purge deleted and a new claim wrote
// again while the first Forget's delete was held back: the new claim
// stays, and Forget does not report true.
func forgetRacedByARecreatedRecordLeavesItAlone(t *testing.T, drv h) {
	drv.Emulator(t)
	a, ra, b, _ := drv.twoOnOneClock(t)
	ctx := t.Context()
	r := doneRecord(t, a, "k")
	ra.WhileLost = func() {
		if ok, err := b.Forget(ctx, r); !ok || err != nil {
			t.Errorf("forget: %v %v", ok, err)
		}
		if c, err := b.Claim(ctx, "k", time.Minute); err != nil || c.Outcome != store.Won {
			t.Errorf("claim: %v %v", c.Outcome, err)
		}
	}
	ra.DropNextCommit.Store(true)
	if ok, err := a.Forget(ctx, r); ok {
		t.Fatalf("forget of a record recreated since its read: %v %v", ok, err)
	}
	if cur, found, err := b.Inspect(ctx, "k"); err != nil || !found || cur.State != store.Claimed || cur.Fence != 1 {
		t.Fatalf("the new claim: %+v %v %v", cur, found, err)
	}
}

// Listing under prefixes whose range bounds are names the service
// reserves (__.*__) or that lie near store.MaxKeyLen, whose records are
// stored encoded: following Next reports exactly the keys under each.
func listAroundReservedAndLongNames(t *testing.T, drv h) {
	drv.Emulator(t)
	b, _ := drv.New(t, Config{})
	ctx := t.Context()
	long := strings.Repeat("L", store.MaxKeyLen-1)
	keys := []string{"__ab_^x", "__ab__", "__ab__x", "__ab_`", "__ab_`__", long + "a", long + "\xff", long[:store.MaxKeyLen-3] + "é", long[:store.MaxKeyLen-2] + "__"}
	for _, k := range keys {
		if r, err := b.Claim(ctx, k, time.Minute); err != nil || r.Outcome != store.Won {
			t.Fatalf("claim %q: %v %v", k[:min(len(k), 20)], r.Outcome, err)
		}
	}
	var prefixes []string
	for _, k := range keys {
		for _, n := range []int{1, 2, 3, 4, 5, 6, len(k) - 3, len(k) - 2, len(k) - 1, len(k)} {
			if n > 0 && n <= len(k) && !slices.Contains(prefixes, k[:n]) {
				prefixes = append(prefixes, k[:n])
			}
		}
	}
	for _, p := range prefixes {
		var want, got []string
		for _, k := range keys {
			if strings.HasPrefix(k, p) {
				want = append(want, k)
			}
		}
		q := store.ListQuery{Prefix: p, Limit: 2}
		for pages := 0; ; pages++ {
			if pages > 100 {
				t.Fatalf("prefix %q: no end after %d pages", p, pages)
			}
			page, err := b.List(ctx, q)
			if err != nil {
				t.Fatalf("list %q (%d bytes): %v", p[:min(len(p), 20)], len(p), err)
			}
			for _, r := range page.Records {
				got = append(got, r.Key)
			}
			if q.Cursor = page.Next; q.Cursor == "" {
				break
			}
		}
		slices.Sort(want)
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("prefix %q (%d bytes): listed %d keys, want %d", p[:min(len(p), 20)], len(p), len(got), len(want))
		}
	}
}

// Two ForceRelease calls of one claim race the same way: only one
// releases, the fence goes up by one, and the first reports false.
func forceReleaseRacedByAnotherReleasesOnce(t *testing.T, drv h) {
	drv.Emulator(t)
	a, ra, b, _ := drv.twoOnOneClock(t)
	ctx := t.Context()
	c, err := a.Claim(ctx, "k", time.Minute)
	if err != nil || c.Outcome != store.Won {
		t.Fatalf("claim: %v %v", c.Outcome, err)
	}
	r, _, _ := a.Inspect(ctx, "k")
	var okB bool
	var errB error
	ra.WhileLost = func() { okB, errB = b.ForceRelease(ctx, r) }
	ra.DropNextCommit.Store(true)
	okA, errA := a.ForceRelease(ctx, r)
	if errB != nil || !okB || okA {
		t.Fatalf("force-releases: first %v %v, second %v %v: want false, true", okA, errA, okB, errB)
	}
	if cur, _, _ := b.Inspect(ctx, "k"); cur.Fence != 2 {
		t.Fatalf("after the race: fence %d, want 2", cur.Fence)
	}
	if ok, _ := a.Complete(ctx, c.Claim); ok {
		t.Fatal("the old holder completed after a force-release")
	}
}

func init() {
	add(
		testCase{"ListOnTheEmulatorCoversEveryKindOfName", listOnTheEmulatorCoversEveryKindOfName},
		testCase{"ForgetRacedByAnotherForgetReportsTrueOnce", forgetRacedByAnotherForgetReportsTrueOnce},
		testCase{"ForgetRacedByARecreatedRecordLeavesItAlone", forgetRacedByARecreatedRecordLeavesItAlone},
		testCase{"ListAroundReservedAndLongNames", listAroundReservedAndLongNames},
		testCase{"ForceReleaseRacedByAnotherReleasesOnce", forceReleaseRacedByAnotherReleasesOnce},
	)
}
