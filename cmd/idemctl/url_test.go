package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// idemctlReal runs the tool with the real opener and no environment.
func idemctlReal(args ...string) result {
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, &out, &errOut, func(string) string { return "" }, openStore)
	return result{code, out.String(), errOut.String()}
}

// A store URL is parsed strictly for every scheme: on ef1025d a ';' in the
// query dropped the option it was in (url.Values.Get), a repeated option
// or an empty table picked one silently, a bad pgx option exited 1 at the
// first query, and a SQLite path holding '?' opened another file. Each is
// a usage error, exit 2, before any I/O.
func TestStoreURLIsParsedStrictly(t *testing.T) {
	dir := t.TempDir()
	for _, url := range []string{
		"redis://127.0.0.1:1?prefix=other;x",
		"redis://127.0.0.1:1?bogus;x",
		"redis://127.0.0.1:1?prefix=a&prefix=b",
		"redis://127.0.0.1:1#frag",
		"rediss://127.0.0.1:1?prefix=%zz",
		"postgres://u@127.0.0.1:1/db?table=t;x",
		"postgres://u@127.0.0.1:1/db?sslmode=bogus",
		"postgres://u@127.0.0.1:1/db?connect_timeout=soon",
		"postgres://u@127.0.0.1:1/db?table=",
		"postgres://u@127.0.0.1:1/db?backend=pq",
		"postgres://u@127.0.0.1:1/db?backend=pgxlock&sslmode=bogus",
		"mysql://u@127.0.0.1:1/db?table=t;x",
		"mysql://u@127.0.0.1:1/db?table=a&table=b",
		"sqlite://" + dir + "/idem.db?table=nope;x",
		"sqlite://" + dir + "/idem.db?table=",
		"sqlite://" + dir + "/typo%3F.db",
		"sqlite://" + dir + "/typo%23.db",
		"sqlite://" + dir + "/typo%25.db",
		"sqlite://" + dir + "/typo%0A.db",
		"sqlite://" + dir + "/idem.db#x",
		"datastore://p?kind=K;x",
		"datastore://user:pw@p",
		"datastore://p:8080",
		"firestore://p?collection=c&collection=d",
		"spanner://projects/p/instances/i/databases/d?table=T;x",
	} {
		r := idemctlReal("forget", "--all", "--yes", "--store", url)
		if r.code != exitUsage || !strings.Contains(r.stderr, "invalid --store") {
			t.Errorf("--store %q: exit %d (%s); want 2, invalid --store", url, r.code, r.stderr)
		}
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 0 {
		t.Errorf("a refused sqlite URL created %v", entries)
	}
}

// The Redis case of the issue, on a real server: `forget --all --yes` with
// a ';' in the prefix option forgot the records of the default prefix on
// ef1025d (exit 0). It must refuse and touch nothing.
func TestSemicolonInRedisURLForgetsNothing(t *testing.T) {
	addr := testsvc.Redis(t)
	p := "idemctl-" + suffix() + ":"
	b, err := openStore(context.Background(), "redis://"+addr, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	defer b.close()
	seedDone(t, b.op, p+"done")
	r := idemctlReal("forget", "--all", "--yes", "--store", "redis://"+addr+"?prefix=other;x")
	if r.code != exitUsage {
		t.Errorf("forget --all --yes with ?prefix=other;x: exit %d, want 2\n%s%s", r.code, r.stdout, r.stderr)
	}
	if _, ok, err := b.op.Inspect(context.Background(), p+"done"); !ok || err != nil {
		t.Errorf("the record of the default prefix is gone: %v %v", ok, err)
	}
}

func seedDone(t *testing.T, op store.Operator, keys ...string) {
	t.Helper()
	ctx := context.Background()
	for _, k := range keys {
		res, err := op.Claim(ctx, k, time.Minute)
		if err != nil || res.Outcome != store.Won {
			t.Fatalf("Claim %q: %v %v", k, res.Outcome, err)
		}
		if ok, err := op.Complete(ctx, res.Claim); !ok || err != nil {
			t.Fatalf("Complete %q: %v %v", k, ok, err)
		}
	}
}
