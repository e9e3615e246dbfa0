package dialect

import (
	"bytes"
	"encoding/base64"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The upper bound of a prefix's key range: the prefix with its trailing
// 0xFF bytes dropped and its last byte raised, compared as bytes. A lone
// byte of a multibyte UTF-8 sequence (0xC3) is a byte like any other
// (bytes.TrimRight would read "\xff" as a rune and trim it too).
func TestSuccessorIsTheLeastStringAboveThePrefixRange(t *testing.T) {
	for _, c := range []struct{ prefix, want string }{
		{"a", "b"}, {"a%", "a&"}, {"a\\", "a]"}, {"\xc3", "\xc4"}, {"é", "\xc3\xaa"},
		{"a\xff", "b"}, {"a\xff\xff", "b"}, {"a\xfe", "a\xff"}, {"\xc3\xff", "\xc4"},
	} {
		got := Successor([]byte(c.prefix))
		if string(got) != c.want {
			t.Errorf("Successor(%q) = %q, want %q", c.prefix, got, c.want)
		}
		for _, k := range []string{c.prefix, c.prefix + "\x01", c.prefix + "\xff\xff\xff", c.prefix + strings.Repeat("\xff", 8)} {
			if bytes.Compare([]byte(k), got) >= 0 {
				t.Errorf("Successor(%q) = %q is not above %q", c.prefix, got, k)
			}
		}
	}
	for _, p := range []string{"", "\xff", "\xff\xff\xff"} {
		if got := Successor([]byte(p)); got != nil {
			t.Errorf("Successor(%q) = %q, want none", p, got)
		}
	}
}

// A cursor whose digest matches but whose key lies outside the prefix (a
// forged one) is refused, as is one of another format, and one issued
// for another table or engine.
func TestForgedCursorIsRefused(t *testing.T) {
	l := Listing{Engine: "sqlite", Table: "idempotency_keys"}
	q := store.ListQuery{Prefix: "a"}
	good := l.Cursor(q, []byte("ab"))
	if last, err := l.ReadCursor(store.ListQuery{Prefix: "a", Cursor: good}); err != nil || string(last) != "ab" {
		t.Fatalf("own cursor: %q %v", last, err)
	}
	raw, _ := base64.RawURLEncoding.DecodeString(l.Cursor(q, []byte("b")))
	badVersion := append([]byte{2}, raw[1:]...)
	for _, c := range []string{
		l.Cursor(q, []byte("b")),
		l.Cursor(q, []byte("a\x00")),
		base64.RawURLEncoding.EncodeToString(raw[:9]),
		base64.RawURLEncoding.EncodeToString(badVersion),
		base64.StdEncoding.EncodeToString(raw),
		Listing{Engine: "sqlite", Table: "other"}.Cursor(q, []byte("ab")),
		Listing{Engine: "postgres", Table: "idempotency_keys"}.Cursor(q, []byte("ab")),
	} {
		if _, err := l.ReadCursor(store.ListQuery{Prefix: "a", Cursor: c}); !errors.Is(err, store.ErrInvalidQuery) {
			t.Errorf("cursor %q: %v, want ErrInvalidQuery", c, err)
		}
	}
}

// Purge deletes in batches of PurgeBatch until one falls short, and stops
// at the limit, asking the last batch for no more than what is left.
func TestPurgeStopsAtAShortBatchOrTheLimit(t *testing.T) {
	for _, c := range []struct {
		limit, rows, want int
		asked             []int
	}{
		{0, 2500, 2500, []int{1000, 1000, 1000}},
		{0, 2000, 2000, []int{1000, 1000, 1000}},
		{1500, 5000, 1500, []int{1000, 500}},
		{300, 100, 100, []int{300}},
	} {
		left := c.rows
		var asked []int
		got, err := Purge(c.limit, func(n int) (int64, error) {
			asked = append(asked, n)
			d := min(n, left)
			left -= d
			return int64(d), nil
		})
		if err != nil || got != c.want || !slices.Equal(asked, c.asked) {
			t.Errorf("Purge(%d) of %d rows = %d, %v asking %v; want %d asking %v", c.limit, c.rows, got, err, asked, c.want, c.asked)
		}
	}
}
