package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var start = time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)

// result is one run of the tool.
type result struct {
	code           int
	stdout, stderr string
}

// idemctl runs the tool in process with open as its opener and no
// environment.
func idemctl(t *testing.T, open opener, args ...string) result {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, &out, &errOut, func(string) string { return "" }, open)
	return result{code, out.String(), errOut.String()}
}

// fakeStore returns an opener of s, which checks the URL and ttl it gets.
func fakeStore(t *testing.T, s *fake.Store) opener {
	return func(_ context.Context, url string, ttl time.Duration) (backend, error) {
		if url != "fake://" {
			t.Errorf("opened %q; want fake://", url)
		}
		if ttl != s.TTL() {
			t.Errorf("opened with ttl %v; want the --ttl given, %v", ttl, s.TTL())
		}
		return backend{op: s, close: func() error { return nil }}, nil
	}
}

// fixture is a fake store at 12:30 holding, with a ttl of an hour:
// orders:1 done at 12:00, orders:2 done at 12:20, orders:3 claimed (lease
// until 12:45), orders:4 claimed (lease lapsed at 12:21), users:1 done at
// 12:00.
func fixture(t *testing.T) (*fake.Store, *fake.Clock, map[string]store.Claim) {
	clock := fake.NewClock(start)
	s := fake.New(fake.WithClock(clock.Now), fake.WithTTL(time.Hour))
	ctx := context.Background()
	claims := map[string]store.Claim{}
	c := func(key string, lease time.Duration) store.Claim {
		res, err := s.Claim(ctx, key, lease)
		if err != nil || res.Outcome != store.Won {
			t.Fatalf("Claim %s: %v %v", key, res.Outcome, err)
		}
		claims[key] = res.Claim
		return res.Claim
	}
	d := func(key string) {
		if ok, err := s.Complete(ctx, c(key, time.Minute)); !ok || err != nil {
			t.Fatalf("Complete %s: %v %v", key, ok, err)
		}
	}
	d("orders:1")
	d("users:1")
	clock.Advance(20 * time.Minute)
	d("orders:2")
	c("orders:4", time.Minute)
	clock.Advance(10 * time.Minute)
	c("orders:3", 15*time.Minute)
	return s, clock, claims
}

// decode decodes out as exactly one JSON document.
func decode(t *testing.T, out string) map[string]any {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(out))
	var doc map[string]any
	if err := dec.Decode(&doc); err != nil {
		t.Fatalf("stdout is not a JSON document: %v\n%s", err, out)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		t.Fatalf("stdout holds more than one JSON document:\n%s", out)
	}
	return doc
}

func TestUsageErrors(t *testing.T) {
	s, _, _ := fixture(t)
	open := fakeStore(t, s)
	for _, args := range [][]string{
		{},
		{"frobnicate"},
		{"get"},
		{"get", "--store=fake://", "a", "b"},
		{"get", "a"}, // no store
		{"get", "--store=fake://", "--ttl=0s", "a"},
		{"get", "--store=fake://", "--bogus", "a"},
		{"list", "--store=fake://", "extra"},
		{"list", "--store=fake://", "--state=lapsed"},
		{"release", "--store=fake://"},
		{"forget", "--store=fake://"},
		{"forget", "--store=fake://", "k", "--yes"},
		{"forget", "--store=fake://", "--prefix=a", "--all"},
		{"forget", "--store=fake://", "--prefix=a", "--yes", "--dry-run"},
		{"forget", "--store=fake://", "--prefix=a", "--done-from=yesterday"},
		{"forget", "--store=fake://", "--prefix=a", "--done-from=2026-11-29T12:00:00Z", "--done-before=2026-11-29T11:00:00Z"},
		{"purge", "--store=fake://", "--limit=-1"},
	} {
		r := idemctl(t, open, args...)
		if r.code != exitUsage || r.stdout != "" || r.stderr == "" {
			t.Errorf("idemctl %q = exit %d, stdout %q, stderr %q; want exit 2 with a message on stderr only", args, r.code, r.stdout, r.stderr)
		}
	}
	if s.Len() != 5 {
		t.Errorf("a usage error changed the store: %d records", s.Len())
	}
}

func TestBadStoreURLsAreUsageErrors(t *testing.T) {
	for _, url := range []string{
		"orders", "ftp://host", "sqlite://host/file.db", "datastore://p?kind=K&bogus=1",
		"firestore://p/extra", "spanner://projects/p/instances/i", "redis://h:6379?nope=1",
		"sqlite:///tmp/x.db?prefix=a", "mysql:///db", "spanner://projects/p/instances/i/databases/d?kind=x",
	} {
		var out, errOut bytes.Buffer
		code := run(context.Background(), []string{"get", "--store", url, "k"}, &out, &errOut, func(string) string { return "" }, openStore)
		if code != exitUsage {
			t.Errorf("--store %q: exit %d (%s); want 2", url, code, errOut.String())
		}
	}
}

func TestHelp(t *testing.T) {
	for _, cmd := range []string{"get", "list", "count", "release", "forget", "purge"} {
		r := idemctl(t, nil, cmd, "--help")
		if r.code != exitOK || !strings.Contains(r.stdout, "Usage: idemctl "+cmd) || !strings.Contains(r.stdout, "Exit codes") || !strings.Contains(r.stdout, "--store") {
			t.Errorf("idemctl %s --help = %d:\n%s%s", cmd, r.code, r.stdout, r.stderr)
		}
	}
	if r := idemctl(t, nil, "help"); r.code != exitOK || !strings.Contains(r.stdout, "spanner://") {
		t.Errorf("idemctl help = %d:\n%s", r.code, r.stdout)
	}
}

func TestStoreFromEnvironment(t *testing.T) {
	s, _, _ := fixture(t)
	var out bytes.Buffer
	env := func(k string) string {
		if k == "IDEMCTL_STORE" {
			return "fake://"
		}
		return ""
	}
	if code := run(context.Background(), []string{"get", "orders:1"}, &out, io.Discard, env, fakeStore(t, s)); code != exitOK {
		t.Errorf("get with IDEMCTL_STORE: exit %d", code)
	}
}

func TestGet(t *testing.T) {
	s, _, _ := fixture(t)
	open := fakeStore(t, s)
	r := idemctl(t, open, "get", "--store=fake://", "orders:3", "--json") // flags after the key too
	if r.code != exitOK {
		t.Fatalf("exit %d: %s", r.code, r.stderr)
	}
	doc := decode(t, r.stdout)
	want := map[string]any{
		"key": "orders:3", "state": "claimed", "fence": 1.0, "lease_expiry": "2026-11-29T12:45:00Z",
		"expires_at": "2026-11-29T13:45:00Z", "now": "2026-11-29T12:30:00Z", "reclaimable": false,
	}
	for k, v := range want {
		if doc[k] != v {
			t.Errorf("%s = %v; want %v", k, doc[k], v)
		}
	}
	if v, _ := doc["version"].(string); len(v) != 16 {
		t.Errorf("version %q is not a 16-digit digest", v)
	}

	r = idemctl(t, open, "get", "--store=fake://", "--json", "orders:2")
	doc = decode(t, r.stdout)
	if doc["done_at"] != "2026-11-29T12:20:00Z" || doc["lease_expiry"] != nil {
		t.Errorf("done record: %v", doc)
	}

	r = idemctl(t, open, "get", "--store=fake://", "orders:1")
	if r.code != exitOK || !strings.Contains(r.stdout, "done, within ttl") || !strings.Contains(r.stdout, "2026-11-29T12:00:00Z") {
		t.Errorf("get text = %d:\n%s", r.code, r.stdout)
	}

	r = idemctl(t, open, "get", "--store=fake://", "--json", "nope")
	if r.code != exitNotFound {
		t.Errorf("get of a missing key: exit %d; want 3", r.code)
	}
	if doc := decode(t, r.stdout); doc["exit"] != 3.0 || doc["key"] != "nope" {
		t.Errorf("get of a missing key printed %v", doc)
	}
}

func TestListAndCount(t *testing.T) {
	s, _, _ := fixture(t)
	open := fakeStore(t, s)
	r := idemctl(t, open, "list", "--store=fake://", "--prefix=orders:", "--state=done", "--json")
	doc := decode(t, r.stdout)
	recs := doc["records"].([]any)
	if r.code != exitOK || len(recs) != 2 || recs[0].(map[string]any)["key"] != "orders:1" || recs[1].(map[string]any)["key"] != "orders:2" || doc["more"] != false {
		t.Errorf("list = %d %v", r.code, doc)
	}
	r = idemctl(t, open, "list", "--store=fake://", "--limit=3")
	if lines := strings.Split(strings.TrimSpace(r.stdout), "\n"); len(lines) != 4 || !strings.Contains(lines[3], "more records follow") {
		t.Errorf("list --limit=3:\n%s", r.stdout)
	}
	r = idemctl(t, open, "count", "--store=fake://", "--prefix=orders:", "--json")
	doc = decode(t, r.stdout)
	for k, v := range map[string]float64{"claimed_live": 1, "claimed_lapsed": 1, "done_live": 2, "done_expired": 0, "total": 4} {
		if doc[k] != v {
			t.Errorf("count %s = %v; want %v", k, doc[k], v)
		}
	}
	r = idemctl(t, open, "count", "--store=fake://")
	if !strings.Contains(r.stdout, "total") || !strings.Contains(r.stdout, "5") {
		t.Errorf("count text:\n%s", r.stdout)
	}
}

func TestRelease(t *testing.T) {
	s, _, claims := fixture(t)
	open := fakeStore(t, s)
	r := idemctl(t, open, "release", "--store=fake://", "--json", "orders:3")
	if r.code != exitOK {
		t.Fatalf("release: exit %d: %s", r.code, r.stderr)
	}
	doc := decode(t, r.stdout)
	before, after := doc["before"].(map[string]any), doc["after"].(map[string]any)
	if before["fence"] != 1.0 || after["fence"] != 2.0 || after["reclaimable"] != true || after["lease_expiry"] != "2026-11-29T12:30:00Z" {
		t.Errorf("release printed %v", doc)
	}
	if ok, _ := s.Complete(context.Background(), claims["orders:3"]); ok {
		t.Error("the released holder still completes")
	}

	r = idemctl(t, open, "release", "--store=fake://", "orders:4")
	if r.code != exitOK || !strings.Contains(r.stdout, "before: orders:4  claimed, free (released or lapsed)  fence 1") || !strings.Contains(r.stdout, "after:  orders:4  claimed, free (released or lapsed)  fence 2") {
		t.Errorf("release text = %d:\n%s", r.code, r.stdout)
	}

	r = idemctl(t, open, "release", "--store=fake://", "--json", "orders:1")
	if r.code != exitFailed || !strings.Contains(r.stderr, "not claimed") {
		t.Errorf("release of a done key = %d %s", r.code, r.stderr)
	}
	if doc := decode(t, r.stdout); doc["before"].(map[string]any)["state"] != "done" {
		t.Errorf("refused release printed %v", doc)
	}
	if r := idemctl(t, open, "release", "--store=fake://", "nope"); r.code != exitNotFound {
		t.Errorf("release of a missing key: exit %d; want 3", r.code)
	}
}

func TestForgetOne(t *testing.T) {
	s, _, _ := fixture(t)
	open := fakeStore(t, s)
	r := idemctl(t, open, "forget", "--store=fake://", "--json", "orders:1")
	doc := decode(t, r.stdout)
	if r.code != exitOK || doc["after"] != nil || doc["before"].(map[string]any)["state"] != "done" {
		t.Errorf("forget = %d %v", r.code, doc)
	}
	if _, ok := s.Record("orders:1"); ok {
		t.Error("orders:1 is still there")
	}
	r = idemctl(t, open, "forget", "--store=fake://", "orders:3")
	if r.code != exitFailed || !strings.Contains(r.stderr, "not done") {
		t.Errorf("forget of a claim = %d %s", r.code, r.stderr)
	}
	if _, ok := s.Record("orders:3"); !ok {
		t.Error("a claim was forgotten")
	}
	if r := idemctl(t, open, "forget", "--store=fake://", "orders:1"); r.code != exitNotFound {
		t.Errorf("forget of a missing key: exit %d; want 3", r.code)
	}
}

func TestForgetPrefix(t *testing.T) {
	s, _, _ := fixture(t)
	open := fakeStore(t, s)

	// Without --yes: the plan, nothing forgotten, exit 1.
	r := idemctl(t, open, "forget", "--store=fake://", "--prefix=orders:")
	if r.code != exitFailed || !strings.Contains(r.stdout, "plan: forget 2 done records") || !strings.Contains(r.stderr, "--yes") || s.Len() != 5 {
		t.Errorf("forget --prefix without --yes = %d, %d records:\n%s%s", r.code, s.Len(), r.stdout, r.stderr)
	}
	// --dry-run: the plan, nothing forgotten, exit 0.
	r = idemctl(t, open, "forget", "--store=fake://", "--prefix=orders:", "--dry-run", "--json", "--done-from=2026-11-29T12:10:00Z")
	doc := decode(t, r.stdout)
	plan := doc["plan"].([]any)
	if r.code != exitOK || len(plan) != 1 || plan[0].(map[string]any)["key"] != "orders:2" || doc["dry_run"] != true || s.Len() != 5 {
		t.Errorf("forget --dry-run = %d %v", r.code, doc)
	}
	// --yes, in a window: orders:1 only (done at 12:00).
	r = idemctl(t, open, "forget", "--store=fake://", "--prefix=orders:", "--yes", "--json", "--done-before=2026-11-29T12:10:00Z")
	doc = decode(t, r.stdout)
	if r.code != exitOK || len(doc["forgotten"].([]any)) != 1 || doc["forgotten"].([]any)[0] != "orders:1" {
		t.Errorf("forget --yes = %d %v", r.code, doc)
	}
	if _, ok := s.Record("users:1"); !ok {
		t.Error("a key outside the prefix was forgotten")
	}
	// --all --yes: every done key left (orders:2, users:1); never a claim.
	r = idemctl(t, open, "forget", "--store=fake://", "--all", "--yes")
	if r.code != exitOK || !strings.Contains(r.stdout, "forgot 2, skipped 0") || s.Len() != 2 {
		t.Errorf("forget --all --yes = %d, %d left:\n%s", r.code, s.Len(), r.stdout)
	}
}

func TestPurge(t *testing.T) {
	s, clock, _ := fixture(t)
	clock.Advance(45 * time.Minute) // 13:15: orders:1 and users:1 expired
	r := idemctl(t, fakeStore(t, s), "purge", "--store=fake://", "--json")
	if doc := decode(t, r.stdout); r.code != exitOK || doc["purged"] != 2.0 {
		t.Errorf("purge = %d %v", r.code, doc)
	}
}

func TestOpenFailure(t *testing.T) {
	open := func(context.Context, string, time.Duration) (backend, error) {
		return backend{}, errors.New("connection refused")
	}
	r := idemctl(t, open, "get", "--store=fake://", "--json", "k")
	if doc := decode(t, r.stdout); r.code != exitFailed || !strings.Contains(doc["error"].(string), "connection refused") {
		t.Errorf("open failure = %d %v", r.code, doc)
	}
}
