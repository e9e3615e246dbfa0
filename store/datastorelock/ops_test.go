package datastorelock_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Keys stored verbatim and encoded (see Name), around every boundary the
// listing draws on entity names: "~", invalid UTF-8, a
// prefix ending inside a character, characters where UTF-8 and UTF-16
// orders disagree.
var listKeys = []string{
	"a", "a.", "a.b", "a/", "a/b", "a0", "ab", "abc", "abcd", "a~", "a\xff", ".", "..", ".a", "..b", "/", "/x", "~", "~a", "~abc",
	"\xc3\xa9", "\xc3\xa9x", "\xff", "__x__", "__x", "\ud7ff", "\ue000", "\uffff", "\U00010000", "z",
}

// Following Next lists exactly the keys under each prefix, each once, on
// the emulator, whatever the prefix: every key above and every prefix of
// one.
func TestListOnTheEmulatorCoversEveryKindOfName(t *testing.T) {
	testsvc.Datastore(t)
	b, _ := newBackend(t)
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
