package spannerlock_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"cloud.google.com/go/spanner"
	dbadmin "cloud.google.com/go/spanner/admin/database/apiv1"
	"cloud.google.com/go/spanner/admin/database/apiv1/databasepb"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
)

// firstSchema is the table as the first version of this package created
// it, before the fingerprint column.
const firstSchema = "CREATE TABLE IdempotencyKeys (\n" +
	"  key BYTES(1024) NOT NULL,\n" +
	"  state INT64 NOT NULL,\n" +
	"  fence INT64 NOT NULL,\n" +
	"  lease_expiry TIMESTAMP NOT NULL,\n" +
	"  expires_at TIMESTAMP NOT NULL,\n" +
	"  token STRING(64) NOT NULL,\n" +
	") PRIMARY KEY (key),\n" +
	"  ROW DELETION POLICY (OLDER_THAN(expires_at, INTERVAL 0 DAY))"

// A Done row keeps the fingerprint that completed it and a Claim that
// finds it reports it; completing the Done row again with the same fence
// is true and changes nothing, the fingerprint included; Complete stores
// none; an invalid fingerprint is refused before any RPC.
func TestCompleteFingerprint(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	b, r := newBackend(t, "")
	claim := func(key string) store.Claim {
		t.Helper()
		res, err := b.Claim(ctx, key, time.Minute)
		if err != nil || res.Outcome != store.Won {
			t.Fatalf("claim %q: %+v %v", key, res, err)
		}
		return res.Claim
	}
	done := func(key, want string) {
		t.Helper()
		res, err := b.Claim(ctx, key, time.Minute)
		if err != nil || res.Outcome != store.AlreadyDone || res.Fingerprint != want {
			t.Fatalf("claim of done %q: %+v %v; want AlreadyDone with fingerprint %q", key, res, err, want)
		}
	}

	c := claim("fp")
	if ok, err := b.CompleteFingerprint(ctx, c, "sha256:one"); !ok || err != nil {
		t.Fatalf("CompleteFingerprint: %v %v", ok, err)
	}
	done("fp", "sha256:one")
	for _, again := range []string{"sha256:two", ""} {
		if ok, err := b.CompleteFingerprint(ctx, c, again); !ok || err != nil {
			t.Fatalf("CompleteFingerprint(%q) of the done row: %v %v", again, ok, err)
		}
		done("fp", "sha256:one")
	}
	if ok, err := b.Complete(ctx, c); !ok || err != nil {
		t.Fatalf("Complete of the done row: %v %v", ok, err)
	}
	done("fp", "sha256:one")

	if ok, err := b.Complete(ctx, claim("plain")); !ok || err != nil {
		t.Fatalf("Complete: %v %v", ok, err)
	}
	done("plain", "")

	c = claim("bad")
	r.take()
	for _, fp := range []string{strings.Repeat("x", store.MaxFingerprintLen+1), "a\x00b", "\xff"} {
		if ok, err := b.CompleteFingerprint(ctx, c, fp); ok || !errors.Is(err, store.ErrInvalidFingerprint) {
			t.Errorf("CompleteFingerprint(%q) = %v %v, want ErrInvalidFingerprint", fp, ok, err)
		}
	}
	if got := r.take(); len(got) != 0 {
		t.Errorf("invalid fingerprints sent %v", got)
	}
	long := strings.Repeat("é", store.MaxFingerprintLen/2) // 128 bytes, 64 characters
	if ok, err := b.CompleteFingerprint(ctx, c, long); !ok || err != nil {
		t.Fatalf("CompleteFingerprint of %d bytes: %v %v", len(long), ok, err)
	}
	done("bad", long)
}

// A table that the first version created, without the fingerprint
// column: the backend's calls fail saying to run EnsureSchema, which adds
// the column; the rows written before keep working (a Done row is
// AlreadyDone with no fingerprint) and new ones keep fingerprints. A
// second EnsureSchema changes nothing.
func TestEnsureSchemaAddsTheFingerprintColumnToAnOlderTable(t *testing.T) {
	addr := testsvc.Spanner(t)
	ctx := t.Context()
	db := testsvc.SpannerDatabase(t, firstSchema)
	client := newClient(t, db, addr, &rpcs{})
	now := time.Now()
	_, err := client.Apply(ctx, []*spanner.Mutation{spanner.Insert(spannerlock.DefaultTable,
		[]string{"key", "state", "fence", "lease_expiry", "expires_at", "token"},
		[]any{[]byte("old"), int64(2), int64(3), now, now.Add(time.Hour), "t"})})
	if err != nil {
		t.Fatal(err)
	}
	b, err := spannerlock.New(client)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Claim(ctx, "old", time.Minute); err == nil || !strings.Contains(err.Error(), "EnsureSchema") {
		t.Fatalf("claim on the older table: %v, want an error naming EnsureSchema", err)
	}

	admin, err := dbadmin.NewDatabaseAdminClient(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	for range 2 {
		if err := b.EnsureSchema(ctx, admin); err != nil {
			t.Fatal(err)
		}
	}
	ddl, err := admin.GetDatabaseDdl(ctx, &databasepb.GetDatabaseDdlRequest{Database: db})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(ddl.GetStatements()); n != 1 || !strings.Contains(ddl.GetStatements()[0], "fingerprint STRING(128)") {
		t.Fatalf("DDL after EnsureSchema: %q", ddl.GetStatements())
	}

	res, err := b.Claim(ctx, "old", time.Minute)
	if err != nil || res.Outcome != store.AlreadyDone || res.Fingerprint != "" {
		t.Fatalf("claim of the older done row: %+v %v; want AlreadyDone without a fingerprint", res, err)
	}
	res, err = b.Claim(ctx, "new", time.Minute)
	if err != nil || res.Outcome != store.Won {
		t.Fatalf("claim: %+v %v", res, err)
	}
	if ok, err := b.CompleteFingerprint(ctx, res.Claim, "fp"); !ok || err != nil {
		t.Fatalf("CompleteFingerprint: %v %v", ok, err)
	}
	if res, err := b.Claim(ctx, "new", time.Minute); err != nil || res.Fingerprint != "fp" {
		t.Fatalf("claim of the new done row: %+v %v", res, err)
	}
}
