package main

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
)

// hostileKeys come from published messages: a key that erases its line, one
// that returns the cursor, one that starts a new line, and one that forges
// a whole record line.
var hostileKeys = []string{
	"orders:1\x1b[2K",
	"orders:2\rorders:9",
	"orders:3\norders:8  claimed, held  fence 1",
	"orders:4  done  fence 7",
	"orders:5\u202etxt.exe",
	"orders:6\"q\\",
}

// checkSafeText fails unless out, text output, holds no byte that moves
// the cursor but the newline ending each line, and each hostile key shows
// only quoted, and it unquotes to the key.
func checkSafeText(t *testing.T, what, out string, wantLines int) {
	t.Helper()
	for i := 0; i < len(out); i++ {
		if b := out[i]; (b < 0x20 && b != '\n') || b == 0x7f {
			t.Errorf("%s: byte %#x at %d reaches the terminal:\n%q", what, b, i, out)
			return
		}
	}
	if strings.ContainsRune(out, '\u202e') {
		t.Errorf("%s: a bidi override reaches the terminal:\n%q", what, out)
	}
	if n := strings.Count(out, "\n"); wantLines >= 0 && n != wantLines {
		t.Errorf("%s: %d lines, want %d:\n%s", what, n, wantLines, out)
	}
	for _, k := range hostileKeys {
		q := strconv.Quote(k)
		if strings.Contains(strings.ReplaceAll(out, q, ""), k) {
			t.Errorf("%s: key %q printed raw:\n%s", what, k, out)
		}
		if u, err := strconv.Unquote(q); err != nil || u != k {
			t.Fatalf("%q does not unquote", q)
		}
	}
}

// Keys in text output cannot move the cursor or start a line: on ef1025d
// `list`, `get`, `release`, `forget` and `forget --dry-run` printed them raw.
// --json is unchanged: the key exactly, as a JSON string.
func TestHostileKeysAreEscapedInText(t *testing.T) {
	clock := fake.NewClock(start)
	s := fake.New(fake.WithClock(clock.Now), fake.WithTTL(time.Hour))
	seedDone(t, s, hostileKeys...)
	res, _ := s.Claim(context.Background(), "orders:7\x1b[31mheld", time.Hour)
	open := fakeStore(t, s)

	r := idemctl(t, open, "list", "--store=fake://")
	checkSafeText(t, "list", r.stdout, len(hostileKeys)+1)
	for _, k := range hostileKeys {
		if !strings.Contains(r.stdout, strconv.Quote(k)+"  done") {
			t.Errorf("list: %q is not shown Go-quoted:\n%s", k, r.stdout)
		}
	}
	if !strings.Contains(r.stdout, "\n"+`"orders:7\x1b[31mheld"  claimed, held`) {
		t.Errorf("list: the held key:\n%s", r.stdout)
	}
	r = idemctl(t, open, "forget", "--store=fake://", "--prefix=orders:", "--dry-run")
	checkSafeText(t, "forget --dry-run", r.stdout, len(hostileKeys)+2)
	for _, k := range hostileKeys {
		r = idemctl(t, open, "get", "--store=fake://", k)
		checkSafeText(t, "get", r.stdout, -1)
		if first, _, _ := strings.Cut(r.stdout, "\n"); !strings.HasPrefix(first, "key ") || !strings.HasSuffix(first, "  "+strconv.Quote(k)) {
			t.Errorf("get %q:\n%s", k, r.stdout)
		}
		r = idemctl(t, open, "get", "--store=fake://", "--json", k)
		if doc := decode(t, r.stdout); doc["key"] != k {
			t.Errorf("get --json: key %q, want %q", doc["key"], k)
		}
	}
	r = idemctl(t, open, "release", "--store=fake://", res.Claim.Key)
	checkSafeText(t, "release", r.stdout+r.stderr, -1)
	r = idemctl(t, open, "forget", "--store=fake://", hostileKeys[2])
	checkSafeText(t, "forget", r.stdout+r.stderr, 3)
	r = idemctl(t, open, "release", "--store=fake://", hostileKeys[1])
	checkSafeText(t, "refused release", r.stdout+r.stderr, 2)
	r = idemctl(t, open, "get", "--store=fake://", "nope\x1b[2K\nforged")
	checkSafeText(t, "get of a missing key", r.stderr, -1)
	if !strings.Contains(r.stderr, `"nope\x1b[2K\nforged"`) {
		t.Errorf("get of a missing key: %s", r.stderr)
	}
}

// An unremarkable key is shown as it is.
func TestPlainKeysAreShownAsTheyAre(t *testing.T) {
	for _, k := range []string{"orders:1", "a/b-c_d.e:f@g", "x"} {
		if showKey(k) != k {
			t.Errorf("showKey(%q) = %q", k, showKey(k))
		}
	}
	for _, k := range []string{"", " ", "a b", `"a"`, `a\b`, "é", "a\x7f"} {
		if got := showKey(k); got != strconv.Quote(k) {
			t.Errorf("showKey(%q) = %q, want %q", k, got, strconv.Quote(k))
		}
	}
}

// A released key, a held one and a done one read differently, and the
// advice never loops: on ef1025d a released key showed "claimed, lease
// lapsed", and forget said "release a claim instead" (which released it
// again, and forget said the same).
func TestReleasedKeyAdviceDoesNotLoop(t *testing.T) {
	s, _, _ := fixture(t)
	open := fakeStore(t, s)
	if r := idemctl(t, open, "release", "--store=fake://", "orders:3"); r.code != exitOK {
		t.Fatalf("release: %d %s", r.code, r.stderr)
	}
	r := idemctl(t, open, "get", "--store=fake://", "orders:3")
	if !strings.Contains(r.stdout, "claimed, free (released or lapsed)") || !strings.Contains(r.stdout, "Nothing to release or forget") {
		t.Errorf("get after release:\n%s", r.stdout)
	}
	r = idemctl(t, open, "forget", "--store=fake://", "orders:3")
	if r.code != exitFailed || !strings.Contains(r.stderr, "nothing to forget") {
		t.Errorf("forget after release = %d:\n%s", r.code, r.stderr)
	}
	if strings.Contains(r.stderr, "release a claim") || strings.Contains(r.stderr, "release the key") {
		t.Errorf("forget of a released key advises a release again:\n%s", r.stderr)
	}
	// A held key's forget says what to do: release it if its holder is gone.
	s.Claim(context.Background(), "orders:10", time.Hour)
	r = idemctl(t, open, "forget", "--store=fake://", "orders:10")
	if r.code != exitFailed || !strings.Contains(r.stderr, "live lease") || !strings.Contains(r.stderr, "release the key") {
		t.Errorf("forget of a held key = %d:\n%s", r.code, r.stderr)
	}
	r = idemctl(t, open, "count", "--store=fake://", "--prefix=orders:")
	for _, want := range []string{"claimed, held", "claimed, free (released or lapsed)", "done, within ttl"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("count lacks %q:\n%s", want, r.stdout)
		}
	}
}

// --help prints the usage once, on stdout; a bad flag prints its error and
// a one-line hint; --done-from takes a date and names the forms it takes;
// --timeout 0 is refused. On ef1025d the first printed the usage on stderr
// too, the second ~30 lines of usage, the third Go's layout error, and the
// fourth was accepted.
func TestFlagErrorsAreShort(t *testing.T) {
	s, _, _ := fixture(t)
	open := fakeStore(t, s)
	r := idemctl(t, open, "get", "--help")
	if r.code != exitOK || r.stderr != "" || strings.Count(r.stdout, "Usage: idemctl get") != 1 {
		t.Errorf("get --help = %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	for _, args := range [][]string{
		{"list", "--store=fake://", "--limit", "x"},
		{"get", "--store=fake://", "--timeout", "soon", "k"},
		{"get", "--store=fake://", "--nope", "k"},
	} {
		r := idemctl(t, open, args...)
		if lines := strings.Count(r.stderr, "\n"); r.code != exitUsage || lines != 2 || !strings.Contains(r.stderr, "--help") {
			t.Errorf("idemctl %q = %d, %d lines:\n%s", args, r.code, lines, r.stderr)
		}
	}
	r = idemctl(t, open, "forget", "--store=fake://", "--prefix=orders:", "--dry-run", "--json", "--done-from=2026-11-29", "--done-before=2026-11-30")
	if doc := decode(t, r.stdout); r.code != exitOK || doc["done_from"] != "2026-11-29T00:00:00Z" || len(doc["plan"].([]any)) != 2 {
		t.Errorf("--done-from as a date = %d %v", r.code, doc)
	}
	r = idemctl(t, open, "forget", "--store=fake://", "--prefix=orders:", "--dry-run", "--done-from=yesterday")
	if r.code != exitUsage || !strings.Contains(r.stderr, "RFC 3339") || !strings.Contains(r.stderr, "2026-12-03") {
		t.Errorf("--done-from=yesterday = %d: %s", r.code, r.stderr)
	}
	for _, tm := range []string{"0", "0s", "-1s"} {
		if r := idemctl(t, open, "get", "--store=fake://", "--timeout", tm, "orders:1"); r.code != exitUsage {
			t.Errorf("--timeout %s = %d; want 2", tm, r.code)
		}
	}
}

// A store that is down: one line that names the server and what to check,
// no go-redis pool noise, no chain of repeated wrappers; and --timeout
// bounds the command. On ef1025d Redis printed its pool's log lines and
// "admin: inspecting "k": redislock: inspect "k": ...", and --timeout 1s
// against a server that never answers took over 3 s (go-redis's own read
// timeout) and said only "context deadline exceeded".
func TestStoreDownIsOneLine(t *testing.T) {
	// A port with nothing behind it.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := l.Addr().String()
	l.Close()
	// A server that accepts and never answers.
	mute, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer mute.Close()
	go func() {
		var held []net.Conn
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for {
			c, err := mute.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	}()
	for _, scheme := range []string{"redis://", "postgres://u:pw@", "mysql://u:pw@"} {
		db := "/db"
		if scheme == "redis://" {
			db = ""
		}
		if scheme == "postgres://u:pw@" {
			db = "/db?sslmode=disable"
		}
		r := idemctlReal("get", "--timeout", "10s", "--store", scheme+closed+db, "k")
		if r.code != exitFailed || strings.Count(r.stderr, "\n") != 1 || !strings.Contains(r.stderr, "cannot reach the server") || !strings.Contains(r.stderr, "check") || strings.Contains(r.stderr, "pool") {
			t.Errorf("%s on a closed port = %d:\n%s", scheme, r.code, r.stderr)
		}
		began := time.Now()
		r = idemctlReal("get", "--timeout", "1s", "--store", scheme+mute.Addr().String()+db, "k")
		took := time.Since(began)
		t.Logf("%s, a server that never answers, --timeout 1s: %v", scheme, took.Round(time.Millisecond))
		if took > 1500*time.Millisecond || took < time.Second {
			t.Errorf("%s: --timeout 1s took %v", scheme, took)
		}
		if r.code != exitFailed || strings.Count(r.stderr, "\n") != 1 || !strings.Contains(r.stderr, "no answer within --timeout 1s") {
			t.Errorf("%s, a server that never answers = %d:\n%s", scheme, r.code, r.stderr)
		}
	}
}

// Keys under a Redis prefix that are not records are skipped by list and
// count, which now say so (on ef1025d they said nothing); and a key with no
// record names where idemctl looked and the option that moves it.
func TestRedisForeignKeysAndNotFoundHint(t *testing.T) {
	addr := testsvc.Redis(t)
	p := "idemctl-" + suffix() + ":"
	url := "redis://" + addr + "?prefix=" + p
	b, err := openStore(context.Background(), url, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	defer b.close()
	seedDone(t, b.op, "orders:1")
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	if err := c.Set(context.Background(), p+"orders:cache", "not a record", 0).Err(); err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{"list", "count"} {
		r := idemctlReal(cmd, "--store", url, "--prefix", "orders:")
		if r.code != exitOK || !strings.Contains(r.stdout, "skipped 1 keys under the prefix that hold no idempotency record") {
			t.Errorf("%s = %d:\n%s%s", cmd, r.code, r.stdout, r.stderr)
		}
		r = idemctlReal(cmd, "--store", url, "--prefix", "orders:", "--json")
		if doc := decode(t, r.stdout); doc["foreign_keys"] != 1.0 {
			t.Errorf("%s --json: %v", cmd, doc)
		}
	}
	r := idemctlReal("get", "--store", "redis://"+addr, "orders:1")
	if r.code != exitNotFound || !strings.Contains(r.stderr, `prefix "idempotency:"`) || !strings.Contains(r.stderr, "?prefix=") {
		t.Errorf("get without ?prefix= = %d:\n%s", r.code, r.stderr)
	}
}

// The SQLite case on disk: a table option with ';' is refused, forgetting
// nothing, and a missing ?table= names the table looked in.
func TestSQLiteTableHint(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.db")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, table := range []string{"?table=mine", ""} {
		b, err := openStore(context.Background(), "sqlite://"+path+table, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		defer b.close()
		ensureSchema(t)(b.op)
		seedDone(t, b.op, "k"+table)
	}
	if r := idemctlReal("forget", "--all", "--yes", "--store", "sqlite://"+path+"?table=nope;x"); r.code != exitUsage {
		t.Errorf("?table=nope;x = %d", r.code)
	}
	if r := idemctlReal("get", "--store", "sqlite://"+path, "k"); r.code != exitOK {
		t.Errorf("the default table's record is gone: %d %s", r.code, r.stderr)
	}
	r := idemctlReal("get", "--store", "sqlite://"+path, "k?table=mine")
	if r.code != exitNotFound || !strings.Contains(r.stderr, "table idempotency_keys") || !strings.Contains(r.stderr, "?table=") {
		t.Errorf("get without ?table= = %d:\n%s", r.code, r.stderr)
	}
}

// A fingerprint is a FingerprintFunc's string, which a function of the
// service's own may build from the payload (a version field, an amount):
// whoever sent the message or created the task chose it. `get` must not
// print it raw either.
func TestHostileFingerprintIsEscapedInGet(t *testing.T) {
	clock := fake.NewClock(start)
	s := fake.New(fake.WithClock(clock.Now), fake.WithTTL(time.Hour))
	ctx := context.Background()
	key := "//cloudtasks.googleapis.com/queues/invoices|send-INV-1"
	res, err := s.Claim(ctx, key, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	fp := "orders-v1:\x1b[2J\x1b[H\u202eforged\nstate\tdone"
	if ok, err := s.CompleteFingerprint(ctx, res.Claim, fp); !ok || err != nil {
		t.Fatalf("complete: %v %v", ok, err)
	}
	r := idemctl(t, fakeStore(t, s), "get", "--store=fake://", key)
	checkSafeText(t, "get", r.stdout, -1)
	if strings.Contains(r.stdout, fp) {
		t.Errorf("get printed the fingerprint raw:\n%q", r.stdout)
	}
}
