package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The password of a --store URL appears nowhere in what idemctl prints:
// not in --help (whose default for --store on main was $IDEMCTL_STORE's
// value, password included), not in the usage a bad flag prints, and not
// in the error for a URL that does not parse (url.Parse quotes the whole
// URL), on stderr or in the --json document.
func TestNoStorePasswordInOutput(t *testing.T) {
	const secret = "s3cretPW"
	urls := []string{
		"postgres://user:" + secret + "@host:port/db",
		"mysql://user:" + secret + "@host:5432x/db",
		"redis://:" + secret + "@host:6379/x",
		"redis://user:" + secret + "@host/0?bogus=1",
		"postgres://user:" + secret + "@host:5432/db\x7f",
		"postgres://user:" + secret + "@ho st:5432/db",
		"sqlite://user:" + secret + "@host/x.db",
		"spanner://user:" + secret + "@projects/p",
	}
	for _, url := range urls {
		env := func(k string) string {
			if k == "IDEMCTL_STORE" {
				return url
			}
			return ""
		}
		for _, args := range [][]string{
			{"get", "--help"},
			{"forget", "--help"},
			{"get", "--no-such-flag", "k"},
			{"list", "--limit", "x"},
			{"get", "k"},
			{"get", "--json", "k"},
			{"get", "--store", url, "--json", "k"},
			{"forget", "--json", "--prefix", "p", "--dry-run"},
		} {
			var out, errOut bytes.Buffer
			code := run(context.Background(), args, &out, &errOut, env, openStore)
			if strings.Contains(out.String()+errOut.String(), secret) {
				t.Errorf("IDEMCTL_STORE=%q idemctl %q (exit %d) printed the password:\nstdout: %s\nstderr: %s", url, args, code, out.String(), errOut.String())
			}
		}
	}
}

// A read-only command on a SQLite path that holds no database creates
// nothing there: on main `idemctl get --store sqlite:///typo.db KEY` left an
// empty database file behind (the driver creates the file it opens).
func TestSQLiteGetCreatesNoFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "typo.db")
	for _, args := range [][]string{
		{"get", "--store", "sqlite://" + path, "k"},
		{"list", "--store", "sqlite://" + path},
		{"count", "--store", "sqlite://" + path},
		{"forget", "--store", "sqlite://" + path, "--prefix", "p", "--dry-run"},
	} {
		var out, errOut bytes.Buffer
		code := run(context.Background(), args, &out, &errOut, func(string) string { return "" }, openStore)
		if code != exitFailed {
			t.Errorf("idemctl %q: exit %d, want 1 (no database there): %s", args, code, errOut.String())
		}
		if _, err := os.Stat(path); err == nil {
			t.Fatalf("idemctl %q created %s", args, path)
		}
	}
}
