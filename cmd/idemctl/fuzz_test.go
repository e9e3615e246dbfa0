package main

import (
	"context"
	"errors"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// FuzzStoreURL: any --store value either opens (the schemes whose opening
// does no I/O: redis, postgres, mysql, sqlite) or fails with an error
// wrapping errStoreURL; a URL that opens has a query that parses strictly
// (no ';', no malformed escape, no repeated option), no fragment, and, for
// sqlite, a path SQLite cannot read as anything but a file name.
func FuzzStoreURL(f *testing.F) {
	for _, s := range []string{
		"redis://127.0.0.1:6379?prefix=other;x", "redis://h:1/2?prefix=a&prefix=b", "rediss://u:p@h:1?prefix=p:",
		"postgres://u:p@h:5432/db?sslmode=disable&table=t", "postgres://u@h/db?sslmode=bogus", "postgresql://h/db?table=;",
		"mysql://u:p@h:3306/db?table=t", "mysql://h/db?parseTime=true&table=x#y",
		"sqlite:///tmp/x.db?table=t", "sqlite:///tmp/typo%3F.db", "sqlite:///tmp/a%23b", "sqlite:///tmp/%00",
		"datastore://p?kind=K", "spanner://projects/p/instances/i/databases/d?table=T", "firestore://p?collection=c",
		"orders", "%zz", "redis://[::1]:1", "sqlite:rel.db",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		u, err := parseStoreURL(raw)
		if err != nil {
			if !errors.Is(err, errStoreURL) {
				t.Fatalf("parseStoreURL(%q): %v does not wrap errStoreURL", raw, err)
			}
			return
		}
		if strings.Contains(u.RawQuery, ";") || strings.Contains(raw, "#") {
			t.Fatalf("parseStoreURL(%q) accepted a ';' or a fragment", raw)
		}
		for k, v := range u.q {
			if len(v) != 1 {
				t.Fatalf("parseStoreURL(%q) accepted option %q %d times", raw, k, len(v))
			}
		}
		switch u.Scheme {
		case "redis", "rediss", "postgres", "postgresql", "mysql", "sqlite":
		default:
			return // opening dials a Google Cloud client
		}
		b, err := openStore(context.Background(), raw, time.Hour)
		if err != nil {
			if !errors.Is(err, errStoreURL) {
				t.Fatalf("openStore(%q): %v does not wrap errStoreURL (opening does no I/O)", raw, err)
			}
			return
		}
		b.close()
		if u.Scheme == "sqlite" {
			p, err := url.Parse(raw)
			if err != nil {
				t.Fatal(err)
			}
			path := p.Path + p.Opaque
			if strings.ContainsAny(path, "?#%") || strings.IndexFunc(path, func(r rune) bool { return r < 0x20 || r == 0x7f }) >= 0 {
				t.Fatalf("openStore(%q) opened the sqlite path %q", raw, path)
			}
		}
	})
}

// FuzzShowKey: whatever a key holds, its text rendering (alone and in a
// record's line) holds no byte that moves the cursor or starts a line and
// no non-printable rune, is the key itself when it does not start with '"',
// and unquotes to the key when it does.
func FuzzShowKey(f *testing.F) {
	for _, s := range []string{"orders:1", "a\x1b[2K", "a\rb", "a\nb  claimed, held", "\"", `\`, "", " ", "é", "\u202e", "\xff", "\x00"} {
		f.Add(s)
	}
	c := &cli{o: opts{ttl: time.Hour}}
	now := time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC)
	f.Fuzz(func(t *testing.T, key string) {
		shown := showKey(key)
		line := c.line(store.Record{Key: key, State: store.Done, Fence: 1, ExpiresAt: now, Version: "v", Now: now})
		for _, s := range []string{shown, line} {
			for i, r := range s {
				if r < 0x20 || r == 0x7f || !strconv.IsPrint(r) && r != ' ' {
					t.Fatalf("showKey(%q): %q at %d in %q", key, r, i, s)
				}
			}
		}
		if !strings.HasPrefix(line, shown+"  ") {
			t.Fatalf("line %q does not start with the shown key %q", line, shown)
		}
		if !strings.HasPrefix(shown, `"`) {
			if shown != key {
				t.Fatalf("showKey(%q) = %q: neither the key nor quoted", key, shown)
			}
			return
		}
		if u, err := strconv.Unquote(shown); err != nil || u != key {
			t.Fatalf("showKey(%q) = %q, which unquotes to %q, %v", key, shown, u, err)
		}
	})
}
