package sqllock

import (
	"database/sql"
	"fmt"
	"slices"
	"strings"

	"github.com/gcp-pubsub-idempotency/idempotency/store/internal/dialect"
)

// Dialect names the SQL of one database engine: [Postgres], [MySQL] or
// [SQLite]. It is a constant, so no importer can change what another
// backend sends. The zero Dialect names none, and [New] refuses it.
type Dialect int

const (
	// Postgres is the dialect of PostgreSQL 9.5 or later (and AlloyDB,
	// Cloud SQL for PostgreSQL), for example through
	// github.com/jackc/pgx/v5/stdlib. Claim is one plain insert when the
	// key is fresh, and that insert and a full claim (an upsert that
	// reports the holder) when it is taken; Complete and Release are one
	// statement.
	Postgres Dialect = iota + 1
	// MySQL is the dialect of MySQL 8 and MariaDB 10.5 or later (and Cloud
	// SQL for MySQL), through github.com/go-sql-driver/mysql. With no
	// RETURNING on an upsert, Claim is an INSERT IGNORE that hands back
	// the lease it wrote through LAST_INSERT_ID (plus, when the key is
	// taken, a read and a conditional UPDATE to reclaim); Complete and
	// Release are one UPDATE.
	MySQL
	// SQLite is the dialect of SQLite 3.35 or later, for example through
	// the pure-Go modernc.org/sqlite. Open the database with a busy timeout
	// (for example _pragma=busy_timeout(10000)) so concurrent writers wait
	// rather than fail. Claim is one statement, plus a read when the key
	// is taken.
	SQLite
)

// String returns the engine's name: postgres, mysql or sqlite.
func (d Dialect) String() string {
	if s := d.sql(); s != nil {
		return s.Name
	}
	return fmt.Sprintf("Dialect(%d)", int(d))
}

// sql returns a new copy of d's SQL, or nil if d names no engine.
func (d Dialect) sql() *dialect.SQL {
	switch d {
	case Postgres:
		return dialect.Postgres()
	case MySQL:
		return dialect.MySQL()
	case SQLite:
		return dialect.SQLite()
	}
	return nil
}

// isolationLevels returns the isolation levels d's engine has, besides
// sql.LevelDefault: PostgreSQL's and MySQL's four SQL levels (PostgreSQL
// runs READ UNCOMMITTED as READ COMMITTED), and SQLite's one, whose
// transactions are serializable.
func (d Dialect) isolationLevels() []sql.IsolationLevel {
	if d == SQLite {
		return []sql.IsolationLevel{sql.LevelSerializable}
	}
	return []sql.IsolationLevel{sql.LevelReadUncommitted, sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable}
}

// checkIsolation fails when d's engine has no isolation level l.
func (d Dialect) checkIsolation(l sql.IsolationLevel) error {
	levels := d.isolationLevels()
	if l == sql.LevelDefault || slices.Contains(levels, l) {
		return nil
	}
	names := make([]string, len(levels))
	for i, v := range levels {
		names[i] = v.String()
	}
	return fmt.Errorf("sqllock: WithTxOptions: isolation level %v: %v has no such level, and every transaction of CompleteTx would fail "+
		"or run at another level (use Default, or one of: %s)", l, d, strings.Join(names, ", "))
}
