// Package dialect holds what packages sqllock and pgxlock share about
// their SQL table: the SQL they send to each engine, with the table's name
// still to fill in ([SQL.Render]), the names it derives from the table's,
// the format of the fingerprint column ([Stamp], [Unstamp]) and of a
// record as Read returns it ([Row]), the key bounds and cursors of a
// listing ([Listing]), the purge's batches ([Purge]), and the retried
// attempts of a claim and a completion with their lost-reply rule
// ([Claim], [Complete]). Both backends render PostgreSQL's table and
// statements from this one source, so a table written by one is read and
// claimed by the other with no migration. It is internal to the store
// tree (so that both modules can import it); sqllock's tests in another
// module (store/sqllock/internal/enginetest, which brings the drivers)
// also evaluate an engine's expression of now with it, while the
// backends' users see only their own options.
package dialect

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var identifier = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// CheckTable splits a table name into its parts (table, or schema and
// table), and fails unless each is a plain identifier of letters, digits
// and underscores, not starting with a digit, at most 63 characters long.
// Its errors start with "table name", for the caller to prefix.
func CheckTable(table string) ([]string, error) {
	parts := strings.Split(table, ".")
	if len(parts) > 2 {
		return nil, fmt.Errorf("table name %q: at most schema.table", table)
	}
	for _, p := range parts {
		if !identifier.MatchString(p) {
			return nil, fmt.Errorf("table name %q: %q is not a plain identifier ([A-Za-z_][A-Za-z0-9_]{0,62})", table, p)
		}
	}
	return parts, nil
}

// Stamp is what the fingerprint column holds for fp completed at fence:
// nil (NULL) for none, else the string "<fence>:<fp>".
func Stamp(fence int64, fp string) any {
	if fp == "" {
		return nil
	}
	return strconv.FormatInt(fence, 10) + ":" + fp
}

// Unstamp returns the fingerprint that the column's value v (nil for
// NULL), read from a Done record at fence, holds: "" for NULL, or for a
// stamp of another fence (left by a completion of an earlier life of the
// record), so that a record never reports a fingerprint for a completion
// that stored none.
func Unstamp(v *string, fence int64) string {
	if v == nil {
		return ""
	}
	f, fp, ok := strings.Cut(*v, ":")
	if !ok || f != strconv.FormatInt(fence, 10) {
		return ""
	}
	return fp
}

// Row is one record as the Read statement returns it (and the Claim,
// List and settle paths read it).
type Row struct {
	State, Fence, Lease, Exp, Now int64
	Token                         string
	// FP is the fingerprint column: nil for NULL, else a stamp.
	FP *string
}

// Dest returns where Read's columns scan to, in their order: state,
// fence, lease expiry, expires-at, token, fingerprint, now.
func (r *Row) Dest() []any {
	return []any{&r.State, &r.Fence, &r.Lease, &r.Exp, &r.Token, &r.FP, &r.Now}
}

// Record is r as key's store.Record: its instants from Unix milliseconds,
// its token as a Version, and (Done only) the fingerprint stamped with
// its fence.
func (r Row) Record(key string) store.Record {
	rec := store.Record{
		Key:         key,
		State:       store.State(r.State),
		Fence:       r.Fence,
		LeaseExpiry: time.UnixMilli(r.Lease),
		ExpiresAt:   time.UnixMilli(r.Exp),
		Version:     store.VersionOf(r.Token),
		Now:         time.UnixMilli(r.Now),
	}
	if rec.State == store.Done {
		rec.Fingerprint = Unstamp(r.FP, r.Fence)
	}
	return rec
}

// SQL is the SQL of one database engine. Each call of [Postgres], [MySQL]
// or [SQLite] returns a new one, so nothing a caller does to it reaches
// another backend.
type SQL struct {
	// Name is the engine's name: postgres, mysql or sqlite.
	Name string
	// quote is the character that quotes an identifier.
	quote string
	// upper is List's condition on the upper bound of the key range.
	upper string
	// Now is the engine's expression of the database's now in Unix
	// milliseconds, truncated to the millisecond.
	Now string
	// Schema is the DDL: the table, then (except MySQL) its index.
	Schema []string
	// ClaimFresh is PostgreSQL's first statement of a claim: a plain
	// insert of a fresh record (fence 1), with the fingerprint named
	// (NULL) as every claim statement names it, that does nothing when
	// the key is taken; it returns the lease expiry it wrote, or no row.
	// Its arguments are Claim's.
	ClaimFresh string
	// Claim is PostgreSQL's claim: one statement for every outcome. It
	// runs when ClaimFresh found the key taken.
	Claim string
	// Upsert is SQLite's insert-or-reclaim, RETURNING the winner.
	Upsert string
	// Insert is MySQL's INSERT IGNORE of a fresh record; its reply's insert
	// id is the lease expiry it wrote.
	Insert string
	// Read reads the record, its fingerprint and the database's now.
	Read string
	// Reclaim is MySQL's conditional reclaim of a lapsed record.
	Reclaim string
	// Complete marks the claim's record done and stores its fingerprint
	// (stamped with the fence, or NULL).
	Complete string
	// CompleteClaimed is Complete that changes only a record still Claimed
	// (state 1) by the claim: the same SET, the same arguments in the same
	// order, one more condition. A transactional completion runs it, so
	// that it finds a record already completed by the same claim, which
	// Complete (on PostgreSQL and SQLite) reports as done again, fenced
	// out. MySQL's Complete already has the condition.
	CompleteClaimed string
	// CompleteTx is CompleteClaimed as a transactional completion runs it
	// (the same arguments in the same order; SQLite's and MySQL's take one
	// more, last: the transaction's marker, see TxMarker). PostgreSQL's also bounds how
	// long the rest of the transaction may stay idle on the server: its
	// RETURNING sets idle_in_transaction_session_timeout to
	// CommitIdleMillis for the transaction (SET LOCAL), so that a commit
	// that never arrives (a frozen client or network) ends the transaction
	// and frees the record's row lock; it also changes nothing unless the
	// transaction-local setting PgTxMarker holds the transaction's marker
	// (its sixth argument): a ROLLBACK or COMMIT statement of the body,
	// after which the mark would run on its own, takes the setting away.
	// MySQL's is MariaDB's: it changes
	// nothing unless the session is still in a transaction
	// (@@in_transaction, which MySQL 8 lacks: there CompleteClaimed runs)
	// and the user variable @sqllock_tx_marker, read from the marker table
	// just before, holds the transaction's marker. SQLite's changes
	// nothing unless the marker table holds the transaction's marker: it
	// is prepared on the transaction's connection, where that TEMP table
	// exists.
	CompleteTx string
	// LockWrites is SQLite's statement that takes the database's write
	// lock for the transaction it runs in, and changes nothing: a
	// transactional completion runs it first, as BEGIN IMMEDIATE would.
	LockWrites string
	// IsDone is MySQL's: is the record done with this fence and token?
	IsDone string
	// Release ends the claim's lease and raises the fence.
	Release string
	// Extend renews the claim's lease.
	Extend string
	// Lease is MySQL's read of the lease expiry after an Extend.
	Lease string
	// Purge deletes a batch of expired records.
	Purge string
	// List reads one window of the key range in key order (the primary
	// key's index): the records with idem_key >= a lower bound and, when
	// {UPPER} is filled in (see [SQL.Render]), below an upper bound, at
	// most a limit of them. It returns one row per record of the window
	// in the selected state (0 selects both), each with the window's last
	// key, its size and the database's now; or, when none is selected,
	// one row of those three with the record's columns NULL.
	List string
	// Forget deletes the record if it is Done by the claim (key, fence,
	// token) still.
	Forget string
	// Returning says that Complete and Extend report through RETURNING
	// (and take their arguments in the order key, fence, ...).
	Returning bool
	// CompleteCounts says that Complete, with Returning's arguments, has
	// no RETURNING and reports through the count of rows it changed (one
	// when the record is Done by the claim): an exec, with no rows for
	// the client to read (PostgreSQL).
	CompleteCounts bool
	// LockDDL, if set, runs before the schema in EnsureSchema's
	// transaction (PostgreSQL's advisory lock).
	LockDDL string
	// HasFingerprint counts the table's fingerprint columns (0 or 1); its
	// arguments are the engine's ProbeArgs.
	HasFingerprint string
	// AddFingerprint adds the fingerprint column to a table created before
	// it existed.
	AddFingerprint string
}

// Quote quotes one identifier in the engine's style.
func (d *SQL) Quote(name string) string { return d.quote + name + d.quote }

// TxMarker names the TEMP table (SQLite, MySQL) in which a transactional
// completion writes, at its transaction's start, one row (k = 1) holding
// a number no earlier transaction of the process wrote: a commit keeps
// it, a rollback takes it back. TEMP tables are per connection, and
// transactional (MySQL: an InnoDB temporary table, whose CREATE does not
// commit implicitly), so the row tells, after the body, whether the
// transaction is still open, has committed (implicitly), or was rolled
// back. On MySQL it is also the name of the user variable the marker is
// read into.
const TxMarker = "sqllock_tx_marker"

// PgTxMarker is the setting that a transactional completion on PostgreSQL
// sets for its transaction only (set_config(..., true), as SET LOCAL) to
// the transaction's marker, which the mark requires (see TxMarker).
const PgTxMarker = "sqllock.tx_marker"

// CommitIdleMillis is how long, in milliseconds, a transactional
// completion's transaction may stay idle on the server after its Done
// mark's UPDATE, waiting for the commit (see SQL.CompleteTx).
const CommitIdleMillis = 5000

// The completions' UPDATE, without its RETURNING: Complete and
// CompleteClaimed share it.
const (
	pgComplete = `UPDATE {T} SET state = 2,
	expires_at_ms = CASE WHEN state = 1 THEN {NOW} + $3 ELSE expires_at_ms END,
	fingerprint = CASE WHEN state = 1 THEN $5 ELSE fingerprint END
WHERE idem_key = $1 AND fence = $2 AND token = $4`
	liteComplete = `UPDATE {T} SET state = 2,
	expires_at_ms = CASE WHEN state = 1 THEN {NOW} + ?3 ELSE expires_at_ms END,
	fingerprint = CASE WHEN state = 1 THEN ?5 ELSE fingerprint END
WHERE idem_key = ?1 AND fence = ?2 AND token = ?4`
	// MySQL compares a VARCHAR by its collation: without case (the
	// default utf8mb4 collations) and, on MariaDB, without trailing spaces.
	// Every token comparison is of bytes (a binary string on one side), so
	// that only the claim's own token matches.
	myComplete = `UPDATE {T} SET state = 2, expires_at_ms = {NOW} + ?, fingerprint = ?
WHERE idem_key = ? AND fence = ? AND token = CAST(? AS BINARY) AND state = 1`
)

// listSQL is SQL.List with its parameters: the lower bound, the limit,
// and the state (twice, for MySQL's positional parameters).
//
// The window is a CTE read in key order on the primary key (idem_key is
// a binary column on every engine: BYTEA, VARBINARY, BLOB, so the order
// and the bounds compare bytes, never a collation). The state filter
// applies to the window, not to the range: a call reads at most limit
// records whatever the filter selects, and the window's last key, which
// every row carries (and the one row, its record columns NULL, when the
// filter selects none of the window), continues the listing. The now is
// read once, in the derived table c, as Read reads it.
//
// A CTE or derived table that a table named like it would shadow, or
// collide with, in the statement that names both is named with a $ (w$,
// and PostgreSQL's clock$, up$ and c$): no table name that sqllock.New
// accepts holds one.
func listSQL(lower, limit, state1, state2 string) string {
	return `WITH w$ AS (
	SELECT idem_key, state, fence, lease_expiry_ms, expires_at_ms, token, fingerprint FROM {T}
	WHERE idem_key >= ` + lower + `{UPPER} ORDER BY idem_key LIMIT ` + limit + `
)
SELECT (SELECT idem_key FROM w$ ORDER BY idem_key DESC LIMIT 1), (SELECT COUNT(*) FROM w$),
	f.idem_key, f.state, f.fence, f.lease_expiry_ms, f.expires_at_ms, f.token, f.fingerprint, c.ms
FROM (SELECT {NOW} AS ms) c LEFT JOIN w$ f ON (` + state1 + ` = 0 OR f.state = ` + state2 + `)
ORDER BY f.idem_key`
}

// Postgres returns the SQL of PostgreSQL 9.5 or later (and AlloyDB, Cloud
// SQL for PostgreSQL), for example through github.com/jackc/pgx/v5/stdlib.
// Claim is one plain insert when the key is fresh, and that insert and the
// full claim when it is taken; Complete and Release are one statement.
func Postgres() *SQL {
	return &SQL{
		Name:  "postgres",
		quote: `"`,
		// floor, not a plain cast: numeric to bigint rounds, which would put
		// now up to half a millisecond ahead of the clock (a lease would end,
		// for a racing Claim, before the LeaseExpiry its holder was given).
		Now: `floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint`,
		Schema: []string{
			`CREATE TABLE IF NOT EXISTS {T} (
	idem_key        BYTEA PRIMARY KEY,
	state           SMALLINT NOT NULL,
	fence           BIGINT NOT NULL,
	lease_expiry_ms BIGINT NOT NULL,
	expires_at_ms   BIGINT NOT NULL,
	token           TEXT NOT NULL,
	fingerprint     TEXT
)`,
			`CREATE INDEX IF NOT EXISTS {I} ON {T} (expires_at_ms)`,
		},
		LockDDL: `SELECT pg_advisory_xact_lock(7213120497)`,
		HasFingerprint: `SELECT count(*) FROM pg_attribute
WHERE attrelid = to_regclass($1) AND attname = 'fingerprint' AND NOT attisdropped`,
		AddFingerprint: `ALTER TABLE {T} ADD COLUMN fingerprint TEXT`,
		// The now is read once, in the derived table c, so that the record
		// expires exactly ttl after its lease (clock_timestamp moves within
		// a statement); a derived table, not a CTE (a CTE scan costs more
		// executor start-up: docs/performance.md).
		ClaimFresh: `INSERT INTO {T} (idem_key, state, fence, lease_expiry_ms, expires_at_ms, token, fingerprint)
SELECT $1, 1, 1, c.ms + $2, c.ms + $2 + $3, $4, NULL FROM (SELECT {NOW} AS ms) c
ON CONFLICT (idem_key) DO NOTHING RETURNING lease_expiry_ms`,
		Claim: `WITH clock$ AS (SELECT {NOW} AS ms),
up$ AS (
	INSERT INTO {T} AS r (idem_key, state, fence, lease_expiry_ms, expires_at_ms, token)
	SELECT $1, 1, 1, ms + $2, ms + $2 + $3, $4 FROM clock$
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
SELECT 1, fence, lease_expiry_ms, 0::bigint, NULL::text FROM up$
UNION ALL
SELECT CASE WHEN t.state = 2 THEN 2 ELSE 3 END, t.fence,
       CASE WHEN t.state = 2 THEN t.expires_at_ms ELSE t.lease_expiry_ms END, clock$.ms,
       CASE WHEN t.state = 2 THEN t.fingerprint END
FROM {T} t, clock$ WHERE t.idem_key = $1 AND NOT EXISTS (SELECT 1 FROM up$)`,
		Read:            `SELECT state, fence, lease_expiry_ms, expires_at_ms, token, fingerprint, {NOW} FROM {T} WHERE idem_key = $1`,
		Complete:        pgComplete,
		CompleteCounts:  true,
		CompleteClaimed: pgComplete + ` AND state = 1 RETURNING 1`,
		CompleteTx: pgComplete + ` AND state = 1 AND current_setting('` + PgTxMarker + `', true) = $6
RETURNING set_config('idle_in_transaction_session_timeout', '` + strconv.Itoa(CommitIdleMillis) + `', true)`,
		Release: `UPDATE {T} SET fence = fence + 1, lease_expiry_ms = c$.ms, expires_at_ms = c$.ms + $3
FROM (SELECT {NOW} AS ms) c$
WHERE idem_key = $1 AND fence = $2 AND token = $4 AND state = 1`,
		Extend: `UPDATE {T} SET lease_expiry_ms = c$.ms + $3, expires_at_ms = c$.ms + $3 + $4
FROM (SELECT {NOW} AS ms) c$
WHERE idem_key = $1 AND fence = $2 AND token = $5 AND state = 1 RETURNING lease_expiry_ms`,
		Purge: `DELETE FROM {T} WHERE idem_key IN (
	SELECT idem_key FROM {T} WHERE expires_at_ms <= {NOW}
	ORDER BY expires_at_ms LIMIT $1 FOR UPDATE SKIP LOCKED
) AND expires_at_ms <= {NOW}`,
		List:      listSQL("$1", "$2", "$3", "$3"),
		upper:     ` AND idem_key < $4`,
		Forget:    `DELETE FROM {T} WHERE idem_key = $1 AND fence = $2 AND token = $3 AND state = 2`,
		Returning: true,
	}
}

// SQLite returns the SQL of SQLite 3.35 or later, for example through the
// pure-Go modernc.org/sqlite. Open the database with a busy timeout (for
// example _pragma=busy_timeout(10000)) so concurrent writers wait rather
// than fail. Claim is one statement, plus a read when the key is taken.
func SQLite() *SQL {
	return &SQL{
		Name:  "sqlite",
		quote: `"`,
		// SQLite's clock is in whole milliseconds, but julianday is a float of
		// days: round to the millisecond it stands for (a plain cast truncated
		// about half of them to the millisecond before).
		Now: `CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)`,
		Schema: []string{
			`CREATE TABLE IF NOT EXISTS {T} (
	idem_key        BLOB PRIMARY KEY,
	state           INTEGER NOT NULL,
	fence           INTEGER NOT NULL,
	lease_expiry_ms INTEGER NOT NULL,
	expires_at_ms   INTEGER NOT NULL,
	token           TEXT NOT NULL,
	fingerprint     TEXT
)`,
			// SQLite qualifies the index, not its table, with the schema.
			`CREATE INDEX IF NOT EXISTS {SI} ON {TN} (expires_at_ms)`,
		},
		HasFingerprint: `SELECT COUNT(*) FROM pragma_table_info(?1, ?2) WHERE name = 'fingerprint'`,
		AddFingerprint: `ALTER TABLE {T} ADD COLUMN fingerprint TEXT`,
		// The fingerprint is named (NULL) so that a table without the column
		// fails the claim before it writes anything.
		Upsert: `INSERT INTO {T} AS r (idem_key, state, fence, lease_expiry_ms, expires_at_ms, token, fingerprint)
VALUES (?1, 1, 1, {NOW} + ?2, {NOW} + ?2 + ?3, ?4, NULL)
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
		Read:            `SELECT state, fence, lease_expiry_ms, expires_at_ms, token, fingerprint, {NOW} FROM {T} WHERE idem_key = ?1`,
		Complete:        liteComplete + ` RETURNING 1`,
		CompleteClaimed: liteComplete + ` AND state = 1 RETURNING 1`,
		CompleteTx: liteComplete + ` AND state = 1
	AND EXISTS (SELECT 1 FROM temp.` + TxMarker + ` WHERE k = 1 AND n = ?6) RETURNING 1`,
		// An UPDATE that matches no row still begins a write transaction:
		// SQLite takes the write lock when a writing statement starts.
		LockWrites: `UPDATE {T} SET state = state WHERE 0`,
		Release: `UPDATE {T} SET fence = fence + 1, lease_expiry_ms = {NOW}, expires_at_ms = {NOW} + ?3
WHERE idem_key = ?1 AND fence = ?2 AND token = ?4 AND state = 1`,
		Extend: `UPDATE {T} SET lease_expiry_ms = {NOW} + ?3, expires_at_ms = {NOW} + ?3 + ?4
WHERE idem_key = ?1 AND fence = ?2 AND token = ?5 AND state = 1 RETURNING lease_expiry_ms`,
		Purge: `DELETE FROM {T} WHERE idem_key IN (
	SELECT idem_key FROM {T} WHERE expires_at_ms <= {NOW} ORDER BY expires_at_ms LIMIT ?1)`,
		List:      listSQL("?1", "?2", "?3", "?3"),
		upper:     ` AND idem_key < ?4`,
		Forget:    `DELETE FROM {T} WHERE idem_key = ?1 AND fence = ?2 AND token = ?3 AND state = 2`,
		Returning: true,
	}
}

// MySQL returns the SQL of MySQL 8 and MariaDB 10.5 or later (and Cloud SQL
// for MySQL), through github.com/go-sql-driver/mysql. With no RETURNING on
// an upsert, Claim is an INSERT IGNORE (plus, when the key is taken, a
// read and a conditional UPDATE to reclaim); Complete and Release are one
// UPDATE.
func MySQL() *SQL {
	return &SQL{
		Name:  "mysql",
		quote: "`",
		// UTC_TIMESTAMP is the session's instant as a UTC wall clock; the
		// distance from the epoch's wall clock is taken without any time zone
		// conversion. (UNIX_TIMESTAMP(NOW(3)) reads the wall clock back through
		// the session time zone: an hour off in a repeated DST hour.)
		Now: `(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)`,
		Schema: []string{
			`CREATE TABLE IF NOT EXISTS {T} (
	idem_key        VARBINARY(1024) NOT NULL PRIMARY KEY,
	state           TINYINT NOT NULL,
	fence           BIGINT NOT NULL,
	lease_expiry_ms BIGINT NOT NULL,
	expires_at_ms   BIGINT NOT NULL,
	token           VARCHAR(64) NOT NULL,
	fingerprint     VARBINARY(160) NULL,
	INDEX {I} (expires_at_ms)
) ENGINE=InnoDB`,
		},
		HasFingerprint: `SELECT COUNT(*) FROM information_schema.columns
WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ? AND column_name = 'fingerprint'`,
		AddFingerprint: `ALTER TABLE {T} ADD COLUMN fingerprint VARBINARY(160) NULL`,
		// The fingerprint is named (NULL) so that a table without the column
		// fails the claim before it writes anything. LAST_INSERT_ID(expr)
		// hands the new lease expiry back in the reply's insert id, so an
		// insert that won needs no read.
		Insert: `INSERT IGNORE INTO {T} (idem_key, state, fence, lease_expiry_ms, expires_at_ms, token, fingerprint)
VALUES (?, 1, 1, LAST_INSERT_ID({NOW} + ?), {NOW} + ? + ?, ?, NULL)`,
		Read: `SELECT state, fence, lease_expiry_ms, expires_at_ms, token, fingerprint, {NOW} FROM {T} WHERE idem_key = ?`,
		Reclaim: `UPDATE {T} SET state = 1, fence = fence + 1, lease_expiry_ms = ?, expires_at_ms = ?, token = CAST(? AS BINARY)
WHERE idem_key = ? AND fence = ? AND state = ?
  AND ((state = 1 AND lease_expiry_ms <= {NOW}) OR (state = 2 AND expires_at_ms <= {NOW}))`,
		Complete:        myComplete,
		CompleteClaimed: myComplete,
		CompleteTx:      myComplete + ` AND @@in_transaction = 1 AND @` + TxMarker + ` = ?`,
		IsDone:          `SELECT COUNT(*) FROM {T} WHERE idem_key = ? AND fence = ? AND token = CAST(? AS BINARY) AND state = 2`,
		Release: `UPDATE {T} SET fence = fence + 1, lease_expiry_ms = {NOW}, expires_at_ms = {NOW} + ?
WHERE idem_key = ? AND fence = ? AND token = CAST(? AS BINARY) AND state = 1`,
		Extend: `UPDATE {T} SET lease_expiry_ms = {NOW} + ?, expires_at_ms = {NOW} + ? + ?
WHERE idem_key = ? AND fence = ? AND token = CAST(? AS BINARY) AND state = 1`,
		Lease: `SELECT lease_expiry_ms FROM {T} WHERE idem_key = ? AND fence = ? AND token = CAST(? AS BINARY) AND state = 1`,
		Purge: `DELETE FROM {T} WHERE expires_at_ms <= {NOW} ORDER BY expires_at_ms LIMIT ?`,
		// Its arguments: the lower bound, the upper bound (ListBelow), the
		// limit, and the state twice.
		List:   listSQL("?", "?", "?", "?"),
		upper:  ` AND idem_key < ?`,
		Forget: `DELETE FROM {T} WHERE idem_key = ? AND fence = ? AND token = CAST(? AS BINARY) AND state = 2`,
	}
}

// Statements is an engine's SQL with the table's name filled in.
type Statements struct {
	// Schema is the DDL, one statement each; Schema1 is all of it as one
	// script, as sqllock's Backend.Schema returns it.
	Schema  []string
	Schema1 string
	LockDDL string
	// The statements of the verbs, as in [SQL].
	ClaimFresh                           string
	Claim, Upsert, Insert, Read, Reclaim string
	Complete, CompleteClaimed            string
	CompleteTx, LockWrites               string
	IsDone, Release, Extend              string
	Lease, Purge                         string
	// List is SQL.List with no upper bound, ListBelow with one.
	List, ListBelow, Forget string
	Returning               bool
	CompleteCounts          bool
	// HasFingerprint and AddFingerprint, as in [SQL].
	HasFingerprint, AddFingerprint string
}

// MaxIdent is the longest identifier every engine takes whole: PostgreSQL
// truncates longer ones to 63 bytes, MySQL refuses more than 64.
const MaxIdent = 63

// IndexName names the index on expires_at_ms of table: table_expires_at
// while that fits in MaxIdent, else the table's first 42 characters, "_exp_"
// and 16 hex digits of the SHA-256 of the whole table name. The long form
// never equals a table name it was derived from (that table would have to
// end in its own hash), nor a short-form name (it ends in hex digits, not
// "_expires_at"), and two long table names share one only if they share
// their first 42 characters and 64 bits of hash.
func IndexName(table string) string {
	if name := table + "_expires_at"; len(name) <= MaxIdent {
		return name
	}
	const sep = "_exp_"
	sum := sha256.Sum256([]byte(table))
	h := hex.EncodeToString(sum[:8])
	return table[:min(len(table), MaxIdent-len(sep)-len(h))] + sep + h
}

// Render fills table (a plain identifier or schema.table, which the caller
// has checked) into d's statements, quoted.
func (d *SQL) Render(table string) Statements {
	parts := strings.Split(table, ".")
	quoted := make([]string, len(parts))
	for i, p := range parts {
		quoted[i] = d.Quote(p)
	}
	r := strings.NewReplacer(
		"{T}", strings.Join(quoted, "."),
		"{I}", d.Quote(IndexName(parts[len(parts)-1])),
		"{SI}", strings.Join(append(quoted[:len(quoted)-1:len(quoted)-1], d.Quote(IndexName(parts[len(parts)-1]))), "."),
		"{TN}", quoted[len(quoted)-1],
		"{NOW}", d.Now,
	)
	s := Statements{
		LockDDL:    d.LockDDL,
		ClaimFresh: r.Replace(d.ClaimFresh),
		Claim:      r.Replace(d.Claim), Upsert: r.Replace(d.Upsert), Insert: r.Replace(d.Insert),
		Read: r.Replace(d.Read), Reclaim: r.Replace(d.Reclaim), Complete: r.Replace(d.Complete),
		CompleteClaimed: r.Replace(d.CompleteClaimed),
		CompleteTx:      r.Replace(d.CompleteTx), LockWrites: r.Replace(d.LockWrites),
		IsDone: r.Replace(d.IsDone), Release: r.Replace(d.Release), Extend: r.Replace(d.Extend),
		Lease: r.Replace(d.Lease), Purge: r.Replace(d.Purge), Returning: d.Returning,
		CompleteCounts: d.CompleteCounts,
		List:           strings.ReplaceAll(r.Replace(d.List), "{UPPER}", ""),
		ListBelow:      strings.ReplaceAll(r.Replace(d.List), "{UPPER}", d.upper),
		Forget:         r.Replace(d.Forget),
		HasFingerprint: d.HasFingerprint, AddFingerprint: r.Replace(d.AddFingerprint),
	}
	for _, q := range d.Schema {
		s.Schema = append(s.Schema, r.Replace(q))
	}
	s.Schema1 = strings.Join(s.Schema, ";\n") + ";"
	return s
}
