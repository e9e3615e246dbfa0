package main

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"
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
