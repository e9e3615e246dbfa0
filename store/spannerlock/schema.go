package spannerlock

import (
	"context"
	"fmt"
	"strings"

	database "cloud.google.com/go/spanner/admin/database/apiv1"
	"cloud.google.com/go/spanner/admin/database/apiv1/databasepb"
)

// Schema returns the DDL that creates the backend's table, with its row
// deletion policy on expires_at.
func (b *Backend) Schema() string { return schema(b.table) }

func schema(table string) string {
	return "CREATE TABLE " + table + " (\n" +
		"  key BYTES(1024) NOT NULL,\n" +
		"  state INT64 NOT NULL,\n" +
		"  fence INT64 NOT NULL,\n" +
		"  lease_expiry TIMESTAMP NOT NULL,\n" +
		"  expires_at TIMESTAMP NOT NULL,\n" +
		"  token STRING(64) NOT NULL,\n" +
		"  fingerprint STRING(128),\n" +
		") PRIMARY KEY (key),\n" +
		"  ROW DELETION POLICY (OLDER_THAN(expires_at, INTERVAL 0 DAY))"
}

// fingerprintColumn is the DDL of the column that CompleteFingerprint
// writes, which tables created before it lack.
const fingerprintColumn = "fingerprint STRING(128)"

// EnsureSchema creates the backend's table ([Backend.Schema]) unless the
// database already has a table of that name, adds the nullable
// fingerprint column to a table that lacks it (one created by a version
// of this package before [Backend.CompleteFingerprint]; its rows keep
// working, with no fingerprint), and waits until the schema change is
// done. admin is a database admin client with the right to read and
// change the database's DDL; nil opens one for the call (honouring
// SPANNER_EMULATOR_HOST, else with Application Default Credentials). It
// checks no other column of an existing table.
func (b *Backend) EnsureSchema(ctx context.Context, admin *database.DatabaseAdminClient) error {
	if admin == nil {
		a, err := database.NewDatabaseAdminClient(ctx)
		if err != nil {
			return fmt.Errorf("spannerlock: opening a database admin client: %w", err)
		}
		defer a.Close()
		admin = a
	}
	db := b.client.DatabaseName()
	ddl, err := admin.GetDatabaseDdl(ctx, &databasepb.GetDatabaseDdlRequest{Database: db})
	if err != nil {
		return fmt.Errorf("spannerlock: reading the DDL of %s: %w", db, err)
	}
	change, what := b.Schema(), "creating table "+b.table
	for _, s := range ddl.GetStatements() {
		if tableOf(s) != strings.ToLower(b.table) {
			continue
		}
		if hasColumn(s, "fingerprint") {
			return nil
		}
		change, what = "ALTER TABLE "+b.table+" ADD COLUMN "+fingerprintColumn, "adding the fingerprint column to "+b.table
		break
	}
	op, err := admin.UpdateDatabaseDdl(ctx, &databasepb.UpdateDatabaseDdlRequest{Database: db, Statements: []string{change}})
	if err != nil {
		return fmt.Errorf("spannerlock: %s: %w", what, err)
	}
	if err := op.Wait(ctx); err != nil {
		// Another process may have made the change meanwhile.
		if msg := strings.ToLower(err.Error()); strings.Contains(msg, "duplicate") || strings.Contains(msg, "already exists") {
			return nil
		}
		return fmt.Errorf("spannerlock: %s: %w", what, err)
	}
	return nil
}

// hasColumn reports whether a CREATE TABLE statement, as GetDatabaseDdl
// returns it (a column per line), defines column.
func hasColumn(stmt, column string) bool {
	for _, line := range strings.Split(stmt, "\n") {
		f := strings.Fields(line)
		if len(f) > 1 && strings.EqualFold(strings.Trim(f[0], "`"), column) {
			return true
		}
	}
	return false
}

// tableOf returns the lower-cased name of the table a CREATE TABLE
// statement creates, or "".
func tableOf(stmt string) string {
	f := strings.Fields(stmt)
	if len(f) < 3 || !strings.EqualFold(f[0], "CREATE") || !strings.EqualFold(f[1], "TABLE") {
		return ""
	}
	name := f[2]
	if i := strings.IndexByte(name, '('); i >= 0 {
		name = name[:i]
	}
	return strings.ToLower(strings.Trim(name, "`"))
}
