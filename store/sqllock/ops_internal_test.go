package sqllock

import (
	"bytes"
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/base64"
	"errors"
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
		got := successor([]byte(c.prefix))
		if string(got) != c.want {
			t.Errorf("successor(%q) = %q, want %q", c.prefix, got, c.want)
		}
		for _, k := range []string{c.prefix, c.prefix + "\x01", c.prefix + "\xff\xff\xff", c.prefix + strings.Repeat("\xff", 8)} {
			if bytes.Compare([]byte(k), got) >= 0 {
				t.Errorf("successor(%q) = %q is not above %q", c.prefix, got, k)
			}
		}
	}
	for _, p := range []string{"", "\xff", "\xff\xff\xff"} {
		if got := successor([]byte(p)); got != nil {
			t.Errorf("successor(%q) = %q, want none", p, got)
		}
	}
}

// A cursor whose digest matches but whose key lies outside the prefix (a
// forged one) is refused, as is one of another format.
func TestForgedCursorIsRefused(t *testing.T) {
	db := sql.OpenDB(noConn{})
	defer db.Close()
	b, err := New(db, SQLite)
	if err != nil {
		t.Fatal(err)
	}
	q := store.ListQuery{Prefix: "a"}
	good := b.cursor(q, []byte("ab"))
	if last, err := b.readCursor(store.ListQuery{Prefix: "a", Cursor: good}); err != nil || string(last) != "ab" {
		t.Fatalf("own cursor: %q %v", last, err)
	}
	raw, _ := base64.RawURLEncoding.DecodeString(b.cursor(q, []byte("b")))
	badVersion := append([]byte{2}, raw[1:]...)
	for _, c := range []string{
		b.cursor(q, []byte("b")),
		b.cursor(q, []byte("a\x00")),
		base64.RawURLEncoding.EncodeToString(raw[:9]),
		base64.RawURLEncoding.EncodeToString(badVersion),
		base64.StdEncoding.EncodeToString(raw),
	} {
		if _, err := b.readCursor(store.ListQuery{Prefix: "a", Cursor: c}); !errors.Is(err, store.ErrInvalidQuery) {
			t.Errorf("cursor %q: %v, want ErrInvalidQuery", c, err)
		}
	}
}

// noConn is a connector whose connections all fail: New does no I/O.
type noConn struct{}

func (noConn) Connect(context.Context) (driver.Conn, error) { return nil, errors.New("no connection") }
func (c noConn) Driver() driver.Driver                      { return c }
func (noConn) Open(string) (driver.Conn, error)             { return nil, errors.New("no connection") }
