package enginetest

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// On MySQL and MariaDB, CompleteTx's TEMP marker table lives in the
// schema of a schema-qualified backend table (WithTable("db.table")), so
// that a connection with no default database (a DSN ending in "/"), on
// which every other verb works, completes too. Found in review of the
// marker (7e6bb3f): its unqualified CREATE and INSERT failed there with
// error 1046 "No database selected", and so did every CompleteTx.
func TestCompleteTxOnAQualifiedTableWithoutADefaultDatabase(t *testing.T) {
	base := testsvc.MariaDB(t)
	createDatabase(t, base, "marker_nodb")
	db := mariadb.open(t, base, nil)
	ctx := context.Background()
	b, err := sqllock.New(db, sqllock.MySQL, sqllock.WithTable(fmt.Sprintf("marker_nodb.t_%016x", rand.Uint64())))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.EnsureSchema(ctx); err != nil {
		t.Fatal(err)
	}
	cl := mustWin(t, b, "k", time.Minute)
	ok, err := b.CompleteTx(ctx, cl, "", func(ctx context.Context, tx *sql.Tx) error { return nil })
	if !ok || err != nil {
		t.Fatalf("CompleteTx on a qualified table, no default database: %v, %v; want true, nil (Claim worked)", ok, err)
	}
}
