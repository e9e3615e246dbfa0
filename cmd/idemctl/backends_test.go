package main

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"cloud.google.com/go/spanner"
	"github.com/go-sql-driver/mysql"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testsvc.StopAll()
	os.Exit(code)
}

// suffix is a random name part, so tests sharing a server do not meet.
func suffix() string { return fmt.Sprintf("%08x", rand.Uint32()) }

// tool runs the tool's main path (the real opener) with args and
// returns its exit code and, with --json, its one JSON document.
func tool(t *testing.T, args ...string) (int, map[string]any) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, &out, &errOut, os.Getenv, openStore)
	if errOut.Len() > 0 {
		t.Logf("idemctl %q: %s", args, errOut.String())
	}
	if !slices.Contains(args, "--json") {
		return code, nil
	}
	return code, decode(t, out.String())
}

// session seeds the store url names and runs every command against it:
// get, list, count, release, forget of one key, forget --prefix (dry run
// and --yes), and purge (which a store that expires its records itself,
// purges false, refuses). prepare, when set, creates the schema.
func session(t *testing.T, url string, purges bool, prepare func(store.Operator)) {
	ctx := context.Background()
	b, err := openStore(ctx, url, time.Hour)
	if err != nil {
		t.Fatalf("opening %s: %v", url, err)
	}
	defer b.close()
	if prepare != nil {
		prepare(b.op)
	}
	p := "idemctl-" + suffix() + ":"
	claim := func(key string, lease time.Duration) store.Claim {
		res, err := b.op.Claim(ctx, key, lease)
		if err != nil || res.Outcome != store.Won {
			t.Fatalf("Claim %s: %v %v", key, res.Outcome, err)
		}
		return res.Claim
	}
	for _, k := range []string{"done1", "done2"} {
		if ok, err := b.op.Complete(ctx, claim(p+k, time.Minute)); !ok || err != nil {
			t.Fatalf("Complete %s: %v %v", k, ok, err)
		}
	}
	held := claim(p+"held", time.Hour)
	st := "--store=" + url

	code, doc := tool(t, "get", st, "--json", p+"done1")
	if code != exitOK || doc["state"] != "done" || doc["fence"] != 1.0 || doc["reclaimable"] != false || doc["expires_at"] == nil {
		t.Errorf("get = %d %v", code, doc)
	}
	if code, _ := tool(t, "get", st, "--json", p+"absent"); code != exitNotFound {
		t.Errorf("get of a missing key: exit %d; want 3", code)
	}

	code, doc = tool(t, "list", st, "--json", "--prefix", p)
	var keys []string
	for _, r := range array(t, doc, "records") {
		keys = append(keys, r.(map[string]any)["key"].(string))
	}
	slices.Sort(keys)
	keys = slices.Compact(keys) // Redis SCAN may repeat a key
	if code != exitOK || !slices.Equal(keys, []string{p + "done1", p + "done2", p + "held"}) {
		t.Errorf("list = %d %v", code, keys)
	}
	code, doc = tool(t, "list", st, "--json", "--prefix", p, "--state", "claimed")
	if recs := array(t, doc, "records"); code != exitOK || len(recs) != 1 || recs[0].(map[string]any)["key"] != p+"held" {
		t.Errorf("list --state claimed = %d %v", code, doc)
	}

	code, doc = tool(t, "count", st, "--json", "--prefix", p)
	if code != exitOK || doc["claimed_live"] != 1.0 || doc["done_live"] != 2.0 || doc["total"] != 3.0 {
		t.Errorf("count = %d %v", code, doc)
	}

	code, doc = tool(t, "release", st, "--json", p+"held")
	if code != exitOK {
		t.Fatalf("release = %d %v", code, doc)
	}
	if before, after := object(t, doc, "before"), object(t, doc, "after"); before["fence"] != 1.0 || after["fence"] != 2.0 || after["reclaimable"] != true {
		t.Errorf("release printed %v", doc)
	}
	if ok, err := b.op.Complete(ctx, held); ok || err != nil {
		t.Errorf("the released holder's Complete = %v, %v; want false", ok, err)
	}
	if code, _ := tool(t, "release", st, "--json", p+"done1"); code != exitFailed {
		t.Errorf("release of a done key: exit %d; want 1", code)
	}

	code, doc = tool(t, "forget", st, "--json", p+"done1")
	if code != exitOK || doc["after"] != nil || object(t, doc, "before")["state"] != "done" {
		t.Errorf("forget = %d %v", code, doc)
	}
	if code, _ := tool(t, "get", st, p+"done1"); code != exitNotFound {
		t.Errorf("get after forget: exit %d; want 3", code)
	}
	if code, _ := tool(t, "forget", st, p+"held"); code != exitFailed {
		t.Errorf("forget of a claim: exit %d; want 1", code)
	}

	code, doc = tool(t, "forget", st, "--json", "--prefix", p, "--dry-run")
	if plan := array(t, doc, "plan"); code != exitOK || len(plan) != 1 || plan[0].(map[string]any)["key"] != p+"done2" {
		t.Errorf("forget --dry-run = %d %v", code, doc)
	}
	code, doc = tool(t, "forget", st, "--json", "--prefix", p, "--yes")
	if f := array(t, doc, "forgotten"); code != exitOK || len(f) != 1 || f[0] != p+"done2" {
		t.Errorf("forget --yes = %d %v", code, doc)
	}
	if code, doc = tool(t, "count", st, "--json", "--prefix", p); doc["total"] != 1.0 || doc["claimed_lapsed"] != 1.0 {
		t.Errorf("count after forget = %d %v", code, doc)
	}

	// An expired record: completed by a service whose ttl is a millisecond.
	short, err := openStore(ctx, url, time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	defer short.close()
	// The claim's lease is long: under load more than a millisecond may
	// pass between Claim and Complete, and a lapsed claim's Complete
	// answers false; the done record's ttl is what must be short.
	if res, err := short.op.Claim(ctx, p+"old", time.Minute); err != nil || res.Outcome != store.Won {
		t.Fatalf("Claim old: %v %v", res.Outcome, err)
	} else if ok, err := short.op.Complete(ctx, res.Claim); !ok || err != nil {
		t.Fatalf("Complete old: %v %v", ok, err)
	}
	for i := 0; ; i++ { // until the store's own clock says the ttl ended
		r, ok, err := short.op.Inspect(ctx, p+"old")
		if err != nil {
			t.Fatal(err)
		}
		if !ok || r.Reclaimable() {
			break
		}
		if i == 500 {
			t.Fatalf("old is not reclaimable after 500 reads: %+v", r)
		}
		time.Sleep(10 * time.Millisecond)
	}
	code, doc = tool(t, "purge", st, "--json")
	if !purges {
		if code != exitFailed {
			t.Errorf("purge on a store that expires its records: exit %d; want 1", code)
		}
		return
	}
	if code != exitOK || doc["purged"] == nil || doc["purged"].(float64) < 1 {
		t.Errorf("purge = %d %v", code, doc)
	}
	if code, _ := tool(t, "get", st, p+"old"); code != exitNotFound {
		t.Errorf("get of a purged key: exit %d; want 3", code)
	}
	if code, _ := tool(t, "get", st, p+"held"); code != exitOK {
		t.Errorf("purge deleted a record that was not expired: exit %d", code)
	}
}

// array returns doc[name], failing the test unless it is a JSON array.
func array(t *testing.T, doc map[string]any, name string) []any {
	t.Helper()
	a, ok := doc[name].([]any)
	if !ok {
		t.Fatalf("%s is not an array in %v", name, doc)
	}
	return a
}

// object returns doc[name], failing the test unless it is a JSON object.
func object(t *testing.T, doc map[string]any, name string) map[string]any {
	t.Helper()
	o, ok := doc[name].(map[string]any)
	if !ok {
		t.Fatalf("%s is not an object in %v", name, doc)
	}
	return o
}

// ensureSchema creates a SQL backend's table.
func ensureSchema(t *testing.T) func(store.Operator) {
	return func(op store.Operator) {
		s, ok := op.(interface{ EnsureSchema(context.Context) error })
		if !ok {
			t.Fatalf("%T has no EnsureSchema", op)
		}
		if err := s.EnsureSchema(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

func TestRedis(t *testing.T) {
	addr := testsvc.Redis(t)
	session(t, "redis://"+addr+"?prefix=idemctl-"+suffix()+":", false, nil)
}

func TestPostgres(t *testing.T) {
	dsn := testsvc.Postgres(t)
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	session(t, dsn+sep+"table=idemctl_"+suffix(), true, ensureSchema(t))
}

// backend=pgxlock reaches the same table through pgxlock.
func TestPostgresThroughPgxlock(t *testing.T) {
	dsn := testsvc.Postgres(t)
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	session(t, dsn+sep+"backend=pgxlock&table=idemctl_"+suffix(), true, ensureSchema(t))
}

func TestMariaDB(t *testing.T) {
	dsn := testsvc.MariaDB(t)
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	name := "idemctl_" + suffix()
	if _, err := db.Exec("CREATE DATABASE " + name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Exec("DROP DATABASE " + name) })
	user := cfg.User
	if cfg.Passwd != "" {
		user += ":" + cfg.Passwd
	}
	session(t, "mysql://"+user+"@"+cfg.Addr+"/"+name, true, ensureSchema(t))
}

func TestSQLite(t *testing.T) {
	// The service creates the database; idemctl only opens it. An empty
	// file is an empty SQLite database.
	path := filepath.Join(t.TempDir(), "idem.db")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	session(t, "sqlite://"+path+"?table=idemctl", true, ensureSchema(t))
}

func TestDatastore(t *testing.T) {
	testsvc.Datastore(t) // sets DATASTORE_EMULATOR_HOST
	session(t, "datastore://idemctl-test?namespace=ns"+suffix(), true, nil)
}

func TestFirestore(t *testing.T) {
	testsvc.Firestore(t) // sets FIRESTORE_EMULATOR_HOST
	session(t, "firestore://idemctl-test?collection=c"+suffix(), true, nil)
}

func TestSpanner(t *testing.T) {
	b, err := spannerlock.New(&spanner.Client{})
	if err != nil {
		t.Fatal(err)
	}
	db := testsvc.SpannerDatabase(t, b.Schema()) // sets SPANNER_EMULATOR_HOST
	session(t, "spanner://"+db, true, nil)
}
