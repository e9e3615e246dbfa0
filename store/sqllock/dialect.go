package sqllock

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
)

// Dialect is the SQL of one database engine. Use Postgres, MySQL or SQLite.
type Dialect struct {
	name     string
	quote    func(string) string
	now      string // epoch milliseconds by the database's clock
	schema   []string
	claim    string // Postgres: one statement for every outcome
	upsert   string // SQLite: insert-or-reclaim, RETURNING the winner
	insert   string // MySQL: INSERT IGNORE of a fresh record
	read     string // the record and the database's now
	reclaim  string // MySQL: conditional reclaim of a lapsed record
	complete string
	isDone   string // MySQL: is the record done with this fence?
	release  string
	extend   string
	lease    string // MySQL: the lease expiry after an extend
	purge    string
	// returning: complete and extend report through RETURNING.
	returning bool
	// lockDDL wraps EnsureSchema in an advisory lock (Postgres).
	lockDDL string
}

// String returns the engine's name.
func (d *Dialect) String() string { return d.name }

// Postgres is the dialect of PostgreSQL 9.5 or later (and AlloyDB, Cloud
// SQL for PostgreSQL), for example through github.com/jackc/pgx/v5/stdlib.
// Claim is one statement; so are Complete and Release.
var Postgres = &Dialect{
	name:  "postgres",
	quote: func(s string) string { return `"` + s + `"` },
	// floor, not a plain cast: numeric to bigint rounds, which would put
	// now up to half a millisecond ahead of the clock (a lease would end,
	// for a racing Claim, before the LeaseExpiry its holder was given).
	now: `floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint`,
	schema: []string{
		`CREATE TABLE IF NOT EXISTS {T} (
	idem_key        BYTEA PRIMARY KEY,
	state           SMALLINT NOT NULL,
	fence           BIGINT NOT NULL,
	lease_expiry_ms BIGINT NOT NULL,
	expires_at_ms   BIGINT NOT NULL,
	token           TEXT NOT NULL
)`,
		`CREATE INDEX IF NOT EXISTS {I} ON {T} (expires_at_ms)`,
	},
	lockDDL: `SELECT pg_advisory_xact_lock(7213120497)`,
	claim: `WITH clock AS (SELECT {NOW} AS ms),
up AS (
	INSERT INTO {T} AS r (idem_key, state, fence, lease_expiry_ms, expires_at_ms, token)
	SELECT $1, 1, 1, ms + $2, ms + $2 + $3, $4 FROM clock
	ON CONFLICT (idem_key) DO UPDATE SET
		state = 1,
		fence = CASE WHEN r.token = EXCLUDED.token THEN r.fence ELSE r.fence + 1 END,
		lease_expiry_ms = CASE WHEN r.token = EXCLUDED.token THEN r.lease_expiry_ms ELSE EXCLUDED.lease_expiry_ms END,
		expires_at_ms = CASE WHEN r.token = EXCLUDED.token THEN r.expires_at_ms ELSE EXCLUDED.expires_at_ms END,
		token = EXCLUDED.token
	WHERE (r.state = 1 AND r.token = EXCLUDED.token)
	   OR (r.state = 1 AND r.lease_expiry_ms <= EXCLUDED.lease_expiry_ms - $2)
	   OR (r.state = 2 AND r.expires_at_ms <= EXCLUDED.lease_expiry_ms - $2)
	RETURNING fence, lease_expiry_ms
)
SELECT 1, fence, lease_expiry_ms, 0::bigint FROM up
UNION ALL
SELECT CASE WHEN t.state = 2 THEN 2 ELSE 3 END, t.fence,
       CASE WHEN t.state = 2 THEN t.expires_at_ms ELSE t.lease_expiry_ms END, clock.ms
FROM {T} t, clock WHERE t.idem_key = $1 AND NOT EXISTS (SELECT 1 FROM up)`,
	read: `SELECT state, fence, lease_expiry_ms, expires_at_ms, token, {NOW} FROM {T} WHERE idem_key = $1`,
	complete: `UPDATE {T} SET state = 2,
	expires_at_ms = CASE WHEN state = 1 THEN {NOW} + $3 ELSE expires_at_ms END
WHERE idem_key = $1 AND fence = $2 AND token = $4 RETURNING 1`,
	release: `UPDATE {T} SET fence = fence + 1, lease_expiry_ms = c.ms, expires_at_ms = c.ms + $3
FROM (SELECT {NOW} AS ms) c
WHERE idem_key = $1 AND fence = $2 AND token = $4 AND state = 1`,
	extend: `UPDATE {T} SET lease_expiry_ms = c.ms + $3, expires_at_ms = c.ms + $3 + $4
FROM (SELECT {NOW} AS ms) c
WHERE idem_key = $1 AND fence = $2 AND token = $5 AND state = 1 RETURNING lease_expiry_ms`,
	purge: `DELETE FROM {T} WHERE idem_key IN (
	SELECT idem_key FROM {T} WHERE expires_at_ms <= {NOW}
	ORDER BY expires_at_ms LIMIT $1 FOR UPDATE SKIP LOCKED
) AND expires_at_ms <= {NOW}`,
	returning: true,
}

// SQLite is the dialect of SQLite 3.35 or later, for example through the
// pure-Go modernc.org/sqlite. Open the database with a busy timeout (for
// example _pragma=busy_timeout(10000)) so concurrent writers wait rather
// than fail. Claim is one statement, plus a read when the key is taken.
var SQLite = &Dialect{
	name:  "sqlite",
	quote: func(s string) string { return `"` + s + `"` },
	// SQLite's clock is in whole milliseconds, but julianday is a float of
	// days: round to the millisecond it stands for (a plain cast truncated
	// about half of them to the millisecond before).
	now: `CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)`,
	schema: []string{
		`CREATE TABLE IF NOT EXISTS {T} (
	idem_key        BLOB PRIMARY KEY,
	state           INTEGER NOT NULL,
	fence           INTEGER NOT NULL,
	lease_expiry_ms INTEGER NOT NULL,
	expires_at_ms   INTEGER NOT NULL,
	token           TEXT NOT NULL
)`,
		// SQLite qualifies the index, not its table, with the schema.
		`CREATE INDEX IF NOT EXISTS {SI} ON {TN} (expires_at_ms)`,
	},
	upsert: `INSERT INTO {T} AS r (idem_key, state, fence, lease_expiry_ms, expires_at_ms, token)
VALUES (?1, 1, 1, {NOW} + ?2, {NOW} + ?2 + ?3, ?4)
ON CONFLICT (idem_key) DO UPDATE SET
	state = 1,
	fence = CASE WHEN r.token = excluded.token THEN r.fence ELSE r.fence + 1 END,
	lease_expiry_ms = CASE WHEN r.token = excluded.token THEN r.lease_expiry_ms ELSE excluded.lease_expiry_ms END,
	expires_at_ms = CASE WHEN r.token = excluded.token THEN r.expires_at_ms ELSE excluded.expires_at_ms END,
	token = excluded.token
WHERE (r.state = 1 AND r.token = excluded.token)
   OR (r.state = 1 AND r.lease_expiry_ms <= excluded.lease_expiry_ms - ?2)
   OR (r.state = 2 AND r.expires_at_ms <= excluded.lease_expiry_ms - ?2)
RETURNING fence, lease_expiry_ms`,
	read: `SELECT state, fence, lease_expiry_ms, expires_at_ms, token, {NOW} FROM {T} WHERE idem_key = ?1`,
	complete: `UPDATE {T} SET state = 2,
	expires_at_ms = CASE WHEN state = 1 THEN {NOW} + ?3 ELSE expires_at_ms END
WHERE idem_key = ?1 AND fence = ?2 AND token = ?4 RETURNING 1`,
	release: `UPDATE {T} SET fence = fence + 1, lease_expiry_ms = {NOW}, expires_at_ms = {NOW} + ?3
WHERE idem_key = ?1 AND fence = ?2 AND token = ?4 AND state = 1`,
	extend: `UPDATE {T} SET lease_expiry_ms = {NOW} + ?3, expires_at_ms = {NOW} + ?3 + ?4
WHERE idem_key = ?1 AND fence = ?2 AND token = ?5 AND state = 1 RETURNING lease_expiry_ms`,
	purge: `DELETE FROM {T} WHERE idem_key IN (
	SELECT idem_key FROM {T} WHERE expires_at_ms <= {NOW} ORDER BY expires_at_ms LIMIT ?1)`,
	returning: true,
}

// MySQL is the dialect of MySQL 8 and MariaDB 10.5 or later (and Cloud SQL
// for MySQL), through github.com/go-sql-driver/mysql. With no RETURNING on
// an upsert, Claim is an INSERT IGNORE and a read (plus a conditional
// UPDATE to reclaim); Complete and Release are one UPDATE.
var MySQL = &Dialect{
	name:  "mysql",
	quote: func(s string) string { return "`" + s + "`" },
	// UTC_TIMESTAMP is the session's instant as a UTC wall clock; the
	// distance from the epoch's wall clock is taken without any time zone
	// conversion. (UNIX_TIMESTAMP(NOW(3)) reads the wall clock back through
	// the session time zone: an hour off in a repeated DST hour.)
	now: `(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)`,
	schema: []string{
		`CREATE TABLE IF NOT EXISTS {T} (
	idem_key        VARBINARY(1024) NOT NULL PRIMARY KEY,
	state           TINYINT NOT NULL,
	fence           BIGINT NOT NULL,
	lease_expiry_ms BIGINT NOT NULL,
	expires_at_ms   BIGINT NOT NULL,
	token           VARCHAR(64) NOT NULL,
	INDEX {I} (expires_at_ms)
) ENGINE=InnoDB`,
	},
	insert: `INSERT IGNORE INTO {T} (idem_key, state, fence, lease_expiry_ms, expires_at_ms, token)
VALUES (?, 1, 1, {NOW} + ?, {NOW} + ? + ?, ?)`,
	read: `SELECT state, fence, lease_expiry_ms, expires_at_ms, token, {NOW} FROM {T} WHERE idem_key = ?`,
	reclaim: `UPDATE {T} SET state = 1, fence = fence + 1, lease_expiry_ms = ?, expires_at_ms = ?, token = ?
WHERE idem_key = ? AND fence = ? AND state = ?
  AND ((state = 1 AND lease_expiry_ms <= {NOW}) OR (state = 2 AND expires_at_ms <= {NOW}))`,
	complete: `UPDATE {T} SET state = 2, expires_at_ms = {NOW} + ? WHERE idem_key = ? AND fence = ? AND token = ? AND state = 1`,
	isDone:   `SELECT COUNT(*) FROM {T} WHERE idem_key = ? AND fence = ? AND token = ? AND state = 2`,
	release: `UPDATE {T} SET fence = fence + 1, lease_expiry_ms = {NOW}, expires_at_ms = {NOW} + ?
WHERE idem_key = ? AND fence = ? AND token = ? AND state = 1`,
	extend: `UPDATE {T} SET lease_expiry_ms = {NOW} + ?, expires_at_ms = {NOW} + ? + ?
WHERE idem_key = ? AND fence = ? AND token = ? AND state = 1`,
	lease: `SELECT lease_expiry_ms FROM {T} WHERE idem_key = ? AND fence = ? AND token = ? AND state = 1`,
	purge: `DELETE FROM {T} WHERE expires_at_ms <= {NOW} ORDER BY expires_at_ms LIMIT ?`,
}

// statements is a dialect's SQL with the table filled in.
type statements struct {
	schema                                                   []string
	lockDDL                                                  string
	claim, upsert, insert, read, reclaim                     string
	complete, isDone, release, extend, lease, purge, schema1 string
}

// maxIdent is the longest identifier every engine takes whole: PostgreSQL
// truncates longer ones to 63 bytes, MySQL refuses more than 64.
const maxIdent = 63

// indexName names the index on expires_at_ms of table: table_expires_at
// while that fits in maxIdent, else the table's first 42 characters, "_exp_"
// and 16 hex digits of the SHA-256 of the whole table name. The long form
// never equals a table name it was derived from (that table would have to
// end in its own hash), nor a short-form name (it ends in hex digits, not
// "_expires_at"), and two long table names share one only if they share
// their first 42 characters and 64 bits of hash.
func indexName(table string) string {
	if name := table + "_expires_at"; len(name) <= maxIdent {
		return name
	}
	const sep = "_exp_"
	sum := sha256.Sum256([]byte(table))
	h := hex.EncodeToString(sum[:8])
	return table[:min(len(table), maxIdent-len(sep)-len(h))] + sep + h
}

func (d *Dialect) render(table string) statements {
	parts := strings.Split(table, ".")
	quoted := make([]string, len(parts))
	for i, p := range parts {
		quoted[i] = d.quote(p)
	}
	r := strings.NewReplacer(
		"{T}", strings.Join(quoted, "."),
		"{I}", d.quote(indexName(parts[len(parts)-1])),
		"{SI}", strings.Join(append(quoted[:len(quoted)-1:len(quoted)-1], d.quote(indexName(parts[len(parts)-1]))), "."),
		"{TN}", quoted[len(quoted)-1],
		"{NOW}", d.now,
	)
	s := statements{
		lockDDL: d.lockDDL,
		claim:   r.Replace(d.claim), upsert: r.Replace(d.upsert), insert: r.Replace(d.insert),
		read: r.Replace(d.read), reclaim: r.Replace(d.reclaim), complete: r.Replace(d.complete),
		isDone: r.Replace(d.isDone), release: r.Replace(d.release), extend: r.Replace(d.extend),
		lease: r.Replace(d.lease), purge: r.Replace(d.purge),
	}
	for _, q := range d.schema {
		s.schema = append(s.schema, r.Replace(q))
	}
	s.schema1 = strings.Join(s.schema, ";\n") + ";"
	return s
}
