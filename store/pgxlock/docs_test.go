package pgxlock_test

import (
	"path/filepath"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/docstest"
)

// docs/effects.md's pgx and sqlc section shows Example_sqlcQueriesInLockTx
// and the sqlc-shaped package it uses, word for word: the code the page
// shows compiles and runs.
func TestTheDocsSqlcExampleIsExampleSqlcQueriesInLockTx(t *testing.T) {
	docstest.ShowsExample(t, filepath.Join("..", "..", "docs", "effects.md"), "## With pgx and sqlc", "Example_sqlcQueriesInLockTx",
		"example_sqlc_test.go", filepath.Join("internal", "orderdb", "db.go"), filepath.Join("internal", "orderdb", "query.sql.go"))
}
