// Package sqllock is a store.Backend on a SQL table through database/sql:
// PostgreSQL, MySQL/MariaDB and SQLite, each with its Dialect.
//
// Bring your own *sql.DB (its pool, driver and credentials); the backend
// only runs statements on it. Time comes from the database's clock (for
// SQLite, which has no server, the process's). Keys are bound as
// parameters, never spliced into SQL; the table name is checked to be a
// plain identifier (optionally schema-qualified) and quoted.
//
// Round trips per operation:
//
//	            Claim (fresh / taken / reclaim)   Complete   Release
//	Postgres    1 / 2 / 2                         1          1
//	SQLite      1 / 2 / 1                         1          1
//	MySQL       1 / 2 / 3                         1 (2 if repeated)   1
//
// CompleteTx adds, to the body's own statements, a begin, the
// transaction's marker, one UPDATE and the commit on PostgreSQL; SQLite
// adds a write that takes its write lock first; MariaDB three round trips
// more (bounding the commit's wait and putting the bound back, and a
// ROLLBACK after the COMMIT it sends as a statement), MySQL 8 two (a
// check that the transaction is still open, and that ROLLBACK). See
// CompleteTx.
//
// The operations (store.Operator) take, on every engine: Inspect one round
// trip, List one per page (reading at most the page's limit of rows: see
// List), ForceRelease and Forget two (a read, then one conditional write
// on the token read).
//
// The table (see Schema for the exact DDL of each dialect):
//
//	idem_key         the key, as bytes (BYTEA / VARBINARY(1024) / BLOB), primary key
//	state            1 claimed, 2 done
//	fence            the fencing token
//	lease_expiry_ms  when the holder's lease ends, Unix milliseconds
//	expires_at_ms    when the record may be deleted, Unix milliseconds (indexed)
//	token            the winning claim's token
//	fingerprint      NULL, or the payload fingerprint of the completing call,
//	                 stamped with the fence it completed ("<fence>:<fp>")
//
// Nothing deletes expired rows by itself: call PurgeExpired now and then.
//
// Complete, Release and Extend match the claim's token as well as its
// fence. Within one life of a record the fence alone decides (each fence
// is won by one Claim), but a record purged after its expires-at instant
// starts again at fence 1: the token keeps a holder from an earlier life
// of the key, still running past its lease and the ttl, from completing,
// releasing or extending the new one.
package sqllock

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/retry"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/internal/dialect"
)

// DefaultTable is the table the backend uses unless WithTable says
// otherwise.
const DefaultTable = "idempotency_keys"

// Option configures a Backend.
type Option func(*Backend)

// WithTable sets the table name: an identifier of letters, digits and
// underscores (not starting with a digit, at most 63 characters), or
// schema.table. Anything else makes New fail.
func WithTable(name string) Option { return func(b *Backend) { b.table = name } }

// WithTTL sets how long a completed key suppresses duplicates, and how long
// a claimed record outlives its lease. Default store.DefaultTTL. Any
// positive ttl is honoured, rounded up to a whole millisecond, and so is
// any positive lease: the table keeps instants as BIGINT milliseconds,
// which hold now + the longest lease + the longest ttl (math.MaxInt64
// each, about 292 years) with room to spare, so none is capped or refused.
func WithTTL(ttl time.Duration) Option { return func(b *Backend) { b.ttl = ttl } }

// WithRetries sets how many more times an operation is sent, with the same
// claim token, after a broken connection, a deadlock, a serialization
// failure or a busy database, waiting a jittered backoff between attempts
// (10ms, doubling up to 320ms). Extend is the exception: an attempt that
// may have renewed the lease without its reply arriving is not sent again
// (a resend would renew it a second time), and Extend returns the error.
// Default 3; negative makes New fail.
func WithRetries(n int) Option { return func(b *Backend) { b.retries = n } }

// WithLogger sets where CompleteTx logs, at warning level, a body whose
// transaction committed before its end (see CompleteTx). Default
// slog.Default().
func WithLogger(l *slog.Logger) Option { return func(b *Backend) { b.logger = l } }

// Backend is a store.Backend on a SQL table. It is safe for concurrent use.
type Backend struct {
	db      *sql.DB
	table   string
	ttl     time.Duration
	retries int
	txOpts  *sql.TxOptions
	logger  *slog.Logger
	d       Dialect
	q       dialect.Statements
	mk      mysqlMarker // the MySQL dialect's marker statements (CompleteTx)
	backoff retry.Policy
	// probe is the arguments of q.HasFingerprint.
	probe []any

	// txConns counts the connections CompleteTx's transactions hold now.
	txConns atomic.Int64

	// mysqlServer is the server behind the MySQL dialect (serverUnknown
	// until CompleteTx's first call finds it out).
	mysqlServer atomic.Int32

	mu       sync.Mutex
	prepared map[string]*preparing
}

var (
	_ store.Backend       = (*Backend)(nil)
	_ store.Extender      = (*Backend)(nil)
	_ store.Purger        = (*Backend)(nil)
	_ store.Fingerprinter = (*Backend)(nil)
)

// New returns a Backend over db in dialect d. It does no I/O: call
// EnsureSchema, or create the table yourself from Schema. It fails if db is
// nil, d is not one of [Postgres], [MySQL] or [SQLite], or an option's
// value is invalid.
func New(db *sql.DB, d Dialect, opts ...Option) (*Backend, error) {
	b := &Backend{db: db, table: DefaultTable, ttl: store.DefaultTTL, retries: 3}
	for _, o := range opts {
		o(b)
	}
	if db == nil {
		return nil, errors.New("sqllock: nil *sql.DB")
	}
	if b.logger == nil {
		b.logger = slog.Default()
	}
	sq := d.sql()
	if sq == nil {
		return nil, fmt.Errorf("sqllock: %v is not a dialect (use sqllock.Postgres, sqllock.MySQL or sqllock.SQLite)", d)
	}
	parts, err := dialect.CheckTable(b.table)
	if err != nil {
		return nil, fmt.Errorf("sqllock: %w", err)
	}
	if err := store.ValidateTTL(b.ttl); err != nil {
		return nil, fmt.Errorf("sqllock: %w", err)
	}
	if b.retries < 0 {
		return nil, fmt.Errorf("sqllock: retries %d is negative", b.retries)
	}
	if b.txOpts != nil && b.txOpts.ReadOnly {
		return nil, errors.New("sqllock: WithTxOptions: a read-only transaction cannot hold the Done mark")
	}
	if b.txOpts != nil {
		if err := d.checkIsolation(b.txOpts.Isolation); err != nil {
			return nil, err
		}
	}
	b.d = d
	b.q = sq.Render(b.table)
	b.mk = newMySQLMarker(b.table)
	schema, name := "", parts[len(parts)-1]
	if len(parts) == 2 {
		schema = parts[0]
	}
	switch d {
	case Postgres:
		b.probe = []any{`"` + strings.Join(parts, `"."`) + `"`}
	case MySQL:
		var s any // NULL: the connection's database
		if schema != "" {
			s = schema
		}
		b.probe = []any{s, name}
	case SQLite:
		if schema == "" {
			schema = "main"
		}
		b.probe = []any{name, schema}
	}
	b.backoff = retry.Policy{Retries: b.retries, Base: 10 * time.Millisecond, Max: 320 * time.Millisecond}
	return b, nil
}

// Schema returns the DDL that EnsureSchema runs on a new database: the
// table and its index on expires_at_ms. (On a table created by an earlier
// version, EnsureSchema also adds the fingerprint column: see
// UpgradeSchema.)
func (b *Backend) Schema() string { return b.q.Schema1 }

// UpgradeSchema returns the DDL that brings a table created by an earlier
// version of this package, before the fingerprint column existed, up to
// date: EnsureSchema runs it when the column is missing. Rows already in
// the table keep working; they carry no fingerprint.
func (b *Backend) UpgradeSchema() string { return b.q.AddFingerprint + ";" }

// TTL returns the ttl the backend applies.
func (b *Backend) TTL() time.Duration { return b.ttl }

// EnsureSchema creates the table and its index if they do not exist, and
// adds the fingerprint column to a table created by an earlier version
// (UpgradeSchema), which takes the engine's table lock for a moment; it
// changes nothing on a table that is up to date. It is safe to call from
// several instances at once.
func (b *Backend) EnsureSchema(ctx context.Context) error {
	err := b.retry(ctx, func() error {
		tx, err := b.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		if b.q.LockDDL != "" {
			if _, err := tx.ExecContext(ctx, b.q.LockDDL); err != nil {
				return err
			}
		}
		for _, q := range b.q.Schema {
			if _, err := tx.ExecContext(ctx, q); err != nil {
				return fmt.Errorf("sqllock: %s: %w", firstLine(q), err)
			}
		}
		var n int
		if err := tx.QueryRowContext(ctx, b.q.HasFingerprint, b.probe...).Scan(&n); err != nil {
			return fmt.Errorf("sqllock: looking for the fingerprint column: %w", err)
		}
		if n == 0 {
			if _, err := tx.ExecContext(ctx, b.q.AddFingerprint); err != nil {
				return fmt.Errorf("sqllock: %s: %w", b.q.AddFingerprint, err)
			}
		}
		return tx.Commit()
	})
	if err != nil {
		// Another instance may have added the column first (MySQL and
		// SQLite take no lock around the check): then all is well.
		var n int
		if b.db.QueryRowContext(ctx, b.q.HasFingerprint, b.probe...).Scan(&n) == nil && n == 1 {
			return nil
		}
	}
	return err
}

// explain adds to err, when it says that the table lacks the fingerprint
// column, what to do about it; it returns any other err unchanged. Every
// Claim statement names the column, so a claim on such a table fails
// before it writes anything, and no body runs.
func (b *Backend) explain(err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	if !strings.Contains(msg, "fingerprint") {
		return err
	}
	var pg interface{ SQLState() string }
	if (errors.As(err, &pg) && pg.SQLState() == "42703") || strings.Contains(msg, "Error 1054") || strings.Contains(msg, "no such column") || strings.Contains(msg, "no column named") {
		return fmt.Errorf("sqllock: the table %s has no fingerprint column (it was created by an earlier version of sqllock): call EnsureSchema once, or run %s: %w", b.table, b.UpgradeSchema(), err)
	}
	return err
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

// millis is d in whole milliseconds, rounded up, the unit of the table's
// instants; store.CeilUnits never overflows, so a duration near
// math.MaxInt64 cannot wrap into the past.
func millis(d time.Duration) int64 { return store.CeilUnits(d, time.Millisecond) }

// preparing is one statement's prepare: the first caller that needs the
// statement runs it, later callers wait for ready (or for their own ctx).
type preparing struct {
	ready chan struct{} // closed when the prepare has ended
	st    *sql.Stmt
	err   error
}

// stmt returns q prepared on b.db, preparing it on first use. Prepared
// statements spare the drivers that would otherwise prepare, execute and
// close on every call (go-sql-driver/mysql: two round trips) or compile
// the SQL every time (SQLite).
//
// The mutex guards only the map: a slow PREPARE holds up no other
// statement, and a caller waiting for the same statement gives up when its
// own ctx ends. A failed prepare is forgotten, so the next caller tries
// again.
func (b *Backend) stmt(ctx context.Context, q string) (*sql.Stmt, error) {
	for {
		b.mu.Lock()
		p, ok := b.prepared[q]
		if !ok {
			p = &preparing{ready: make(chan struct{})}
			if b.prepared == nil {
				b.prepared = make(map[string]*preparing)
			}
			b.prepared[q] = p
			b.mu.Unlock()
			return b.prepare(ctx, q, p)
		}
		b.mu.Unlock()
		select {
		case <-p.ready:
			if p.err == nil {
				return p.st, nil
			}
			// The preparer failed, perhaps because its own ctx ended: its
			// entry is gone, so the next round prepares anew.
			if err := ctx.Err(); err != nil {
				return nil, err
			}
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// prepare runs the prepare that p stands for and publishes its result.
func (b *Backend) prepare(ctx context.Context, q string, p *preparing) (*sql.Stmt, error) {
	st, err := b.db.PrepareContext(ctx, q)
	b.mu.Lock()
	current := b.prepared[q] == p
	if err != nil && current {
		delete(b.prepared, q)
	}
	b.mu.Unlock()
	if err == nil && !current {
		// Close ran while the statement was being prepared.
		st.Close()
		st, err = nil, errClosed
	}
	p.st, p.err = st, err
	close(p.ready)
	return st, err
}

var errClosed = errors.New("sqllock: the backend was closed while the statement was being prepared")

// queryRow runs q, prepared, and scans its one row into dest.
func (b *Backend) queryRow(ctx context.Context, q string, args []any, dest ...any) error {
	st, err := b.stmt(ctx, q)
	if err != nil {
		return err
	}
	return st.QueryRowContext(ctx, args...).Scan(dest...)
}

// exec runs q, prepared, and returns the rows it affected.
func (b *Backend) exec(ctx context.Context, q string, args ...any) (int64, error) {
	st, err := b.stmt(ctx, q)
	if err != nil {
		return 0, err
	}
	res, err := st.ExecContext(ctx, args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// Close releases the prepared statements. It does not close the *sql.DB,
// which belongs to the caller.
//
// A statement still being prepared is closed when its prepare ends; a
// later call on the backend prepares its statements anew.
func (b *Backend) Close() error {
	b.mu.Lock()
	prepared := b.prepared
	b.prepared = nil
	b.mu.Unlock()
	var errs []error
	for _, p := range prepared {
		select {
		case <-p.ready:
			if p.st != nil {
				errs = append(errs, p.st.Close())
			}
		default:
			// Still preparing: close the statement once it is there.
			go func() {
				<-p.ready
				if p.st != nil {
					p.st.Close()
				}
			}()
		}
	}
	return errors.Join(errs...)
}

// row is a record as Read returns it.
type row = dialect.Row

// stamp is what the fingerprint column holds for fp completed at fence
// (dialect.Stamp).
func stamp(fence int64, fp string) any { return dialect.Stamp(fence, fp) }

// unstamp returns the fingerprint that v (nil for NULL), read from a
// Done record at fence, holds (dialect.Unstamp). A stamp of another fence is left by a
// Complete of an earlier life of the record, overwritten by this
// package's next Complete but not by an earlier version's (which knows no
// fingerprints), so a table shared by instances of both during an upgrade
// never reports a fingerprint for a completion that stored none.
func unstamp(v *string, fence int64) string { return dialect.Unstamp(v, fence) }

func (b *Backend) read(ctx context.Context, key []byte) (r row, found bool, err error) {
	err = b.queryRow(ctx, b.q.Read, []any{key}, r.Dest()...)
	if errors.Is(err, sql.ErrNoRows) {
		return r, false, nil
	}
	return r, err == nil, err
}

// judge turns a record someone else holds into a Result; ok is false when
// the record is reclaimable (or ours) and needs a write.
func judge(r row, token string) (store.Result, bool) {
	switch {
	case r.State == 1 && r.Token == token:
		return store.Result{}, false
	case r.State == 2 && r.Now < r.Exp:
		return store.Result{Outcome: store.AlreadyDone, Until: time.UnixMilli(r.Exp), Fingerprint: unstamp(r.FP, r.Fence)}, true
	case r.State == 1 && r.Now < r.Lease:
		return store.Result{Outcome: store.HeldByOther, Until: time.UnixMilli(r.Lease)}, true
	}
	return store.Result{}, false
}

var errRace = errors.New("sqllock: the record changed between reading and writing it")

// Claim implements store.Backend.
func (b *Backend) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Result{}, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return store.Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return store.Result{}, fmt.Errorf("sqllock: claim %q: %w", key, err)
	}
	token := store.NewToken()
	k := []byte(key)
	// dialect.Claim keeps the error of the first attempt whose reply was
	// lost: from then on a retry that finds someone else's record answers
	// an error, never HeldByOther or AlreadyDone.
	res, err := dialect.Claim(func(op func() error) error { return b.retry(ctx, op) }, func() (store.Result, error) {
		switch {
		case b.q.Claim != "":
			return b.claimOne(ctx, k, lease, token)
		case b.q.Upsert != "":
			return b.claimUpsert(ctx, k, lease, token)
		}
		return b.claimMySQL(ctx, k, lease, token)
	}, errRace, mayHaveLanded)
	if err != nil {
		if missing := b.explain(err); missing != err {
			// The statement was refused: nothing was written.
			return store.Result{}, fmt.Errorf("sqllock: claim %q: %w", key, missing)
		}
		return store.Result{}, fmt.Errorf("sqllock: claim %q (outcome unknown: the key may be held until its lease lapses): %w", key, err)
	}
	res.Claim.Key = key
	return res, nil
}

func won(fence, lease int64, token string) store.Result {
	return store.Result{Outcome: store.Won, Claim: store.Claim{Fence: fence, Token: token, LeaseExpiry: time.UnixMilli(lease)}}
}

// claimOne: Postgres. A plain insert first, which wins a fresh key; when
// the key is taken, the full claim, every outcome in one statement. The
// full claim also answers a resend of this claim (its token) whose
// insert landed unseen: the record's own lease, fence 1, Won.
func (b *Backend) claimOne(ctx context.Context, k []byte, lease time.Duration, token string) (store.Result, error) {
	args := []any{k, millis(lease), millis(b.ttl), token}
	var until int64
	err := b.queryRow(ctx, b.q.ClaimFresh, args, &until)
	if err == nil {
		return won(1, until, token), nil
	}
	if !errors.Is(err, sql.ErrNoRows) {
		return store.Result{}, err
	}
	var outcome, fence, now int64
	var fp *string
	err = b.queryRow(ctx, b.q.Claim, args, &outcome, &fence, &until, &now, &fp)
	if errors.Is(err, sql.ErrNoRows) {
		// A concurrent insert committed after this statement's snapshot:
		// the conflict saw the row, the snapshot did not. Look again.
		return store.Result{}, errRace
	}
	if err != nil {
		return store.Result{}, err
	}
	if outcome == 1 {
		return won(fence, until, token), nil
	}
	if until <= now {
		// The final read sees the statement's snapshot, taken before a
		// concurrent reclaim committed: it shows a lapsed lease or an
		// expired Done record that the conflict check found already
		// reclaimed. Neither answer may be given from it (an expired Done
		// record would be acked as a duplicate of work another caller now
		// holds): look again, with a fresh snapshot.
		return store.Result{}, errRace
	}
	if outcome == 2 {
		return store.Result{Outcome: store.AlreadyDone, Until: time.UnixMilli(until), Fingerprint: unstamp(fp, fence)}, nil
	}
	return store.Result{Outcome: store.HeldByOther, Until: time.UnixMilli(until)}, nil
}

// claimUpsert: SQLite, the upsert, and a read when the key is taken.
func (b *Backend) claimUpsert(ctx context.Context, k []byte, lease time.Duration, token string) (store.Result, error) {
	var fence, until int64
	err := b.queryRow(ctx, b.q.Upsert, []any{k, millis(lease), millis(b.ttl), token}, &fence, &until)
	if err == nil {
		return won(fence, until, token), nil
	}
	if !errors.Is(err, sql.ErrNoRows) {
		return store.Result{}, err
	}
	r, found, err := b.read(ctx, k)
	if err != nil {
		return store.Result{}, err
	}
	if !found {
		return store.Result{}, errRace
	}
	if res, ok := judge(r, token); ok {
		return res, nil
	}
	if r.State == 1 && r.Token == token {
		return won(r.Fence, r.Lease, token), nil
	}
	return store.Result{}, errRace
}

// claimMySQL: INSERT IGNORE; when the key is taken, a read, then a
// conditional reclaim.
func (b *Backend) claimMySQL(ctx context.Context, k []byte, lease time.Duration, token string) (store.Result, error) {
	lms, tms := millis(lease), millis(b.ttl)
	st, err := b.stmt(ctx, b.q.Insert)
	if err != nil {
		return store.Result{}, err
	}
	res, err := st.ExecContext(ctx, k, lms, lms, tms, token)
	if err != nil {
		return store.Result{}, err
	}
	inserted, err := res.RowsAffected()
	if err != nil {
		return store.Result{}, err
	}
	if inserted == 1 {
		// The insert won fence 1; LAST_INSERT_ID(expr) put the lease
		// expiry it wrote into the reply.
		// (A server or proxy that does not pass it on leaves it 0: then
		// read the record, as for a taken key.)
		if until, err := res.LastInsertId(); err == nil && until > 0 {
			return won(1, until, token), nil
		}
	}
	r, found, err := b.read(ctx, k)
	if err != nil {
		return store.Result{}, err
	}
	if found && r.State == 1 && r.Token == token {
		return won(r.Fence, r.Lease, token), nil
	}
	if !found {
		return store.Result{}, errRace
	}
	if res, ok := judge(r, token); ok {
		return res, nil
	}
	newLease := r.Now + lms
	n, err := b.exec(ctx, b.q.Reclaim, newLease, newLease+tms, token, k, r.Fence, r.State)
	if err != nil {
		return store.Result{}, err
	}
	if n == 1 {
		return won(r.Fence+1, newLease, token), nil
	}
	return store.Result{}, errRace
}

// Complete implements store.Backend. It clears a fingerprint left from an
// earlier life of the record.
func (b *Backend) Complete(ctx context.Context, c store.Claim) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	return b.complete(ctx, c, "")
}

// CompleteFingerprint implements store.Fingerprinter: Complete, storing fp
// in the record it moves to Done.
func (b *Backend) CompleteFingerprint(ctx context.Context, c store.Claim, fp string) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	if err := store.ValidateFingerprint(fp); err != nil {
		return false, err
	}
	return b.complete(ctx, c, fp)
}

func (b *Backend) complete(ctx context.Context, c store.Claim, fp string) (bool, error) {
	k := []byte(c.Key)
	stamped := stamp(c.Fence, fp)
	// dialect.Complete keeps the error of the first attempt that may have
	// completed the record unseen: a later attempt that finds nothing to
	// complete then answers an error, never false.
	var done bool
	attempt := func() error {
		if b.q.CompleteCounts {
			// An exec: no rows to read (and, on a context that can be
			// cancelled, no goroutine of database/sql's to watch them).
			n, err := b.exec(ctx, b.q.Complete, k, c.Fence, millis(b.ttl), c.Token, stamped)
			done = err == nil && n == 1
			return err
		}
		if b.q.Returning {
			var one int
			err := b.queryRow(ctx, b.q.Complete, []any{k, c.Fence, millis(b.ttl), c.Token, stamped}, &one)
			if errors.Is(err, sql.ErrNoRows) {
				done = false
				return nil
			}
			done = err == nil
			return err
		}
		n, err := b.exec(ctx, b.q.Complete, millis(b.ttl), stamped, k, c.Fence, c.Token)
		if err != nil || n == 1 {
			done = n == 1
			return err
		}
		// Nothing changed: either the fence is stale, or an earlier try
		// already completed it.
		var count int
		err = b.queryRow(ctx, b.q.IsDone, []any{k, c.Fence, c.Token}, &count)
		done = count == 1
		return err
	}
	done, err := dialect.Complete(func(op func() error) error { return b.retry(ctx, op) }, func() (bool, error) {
		err := attempt()
		return done, err
	}, mayHaveLanded)
	if err != nil {
		return false, fmt.Errorf("sqllock: complete %q fence %d: %w", c.Key, c.Fence, b.explain(err))
	}
	return done, nil
}

// Release implements store.Backend.
func (b *Backend) Release(ctx context.Context, c store.Claim) error {
	if err := store.ValidateKey(c.Key); err != nil {
		return err
	}
	if err := b.release(ctx, []byte(c.Key), c); err != nil {
		return fmt.Errorf("sqllock: release %q fence %d: %w", c.Key, c.Fence, err)
	}
	return nil
}

// release ends c's lease and raises the fence if the record k is still
// Claimed by c, retrying.
func (b *Backend) release(ctx context.Context, k []byte, c store.Claim) error {
	return b.retry(ctx, func() error {
		var err error
		if b.q.Returning {
			_, err = b.exec(ctx, b.q.Release, k, c.Fence, millis(b.ttl), c.Token)
		} else {
			_, err = b.exec(ctx, b.q.Release, millis(b.ttl), k, c.Fence, c.Token)
		}
		return err
	})
}

// renewable fails when the pool may open one connection
// (sql.DB.SetMaxOpenConns(1)) and a transaction of CompleteTx holds it: a
// renewal would wait for that transaction to end, and the lease it renews
// is that transaction's own (WithHeartbeat). On a larger pool a renewal
// waits for a connection, which another delivery's end frees.
func (b *Backend) renewable(c store.Claim) error {
	if b.txConns.Load() == 0 || b.db.Stats().MaxOpenConnections != 1 {
		return nil
	}
	return fmt.Errorf("sqllock: extend %q fence %d: cannot renew the lease now: the pool's only connection (SetMaxOpenConns(1)) "+
		"is held by a transaction of CompleteTx (under WithHeartbeat, the body's own), and a renewal needs another; "+
		"allow the pool more connections than there are transactional deliveries at once, or keep the body within its lease", c.Key, c.Fence)
}

// Extend implements store.Extender. It renews the lease at most once per
// call: after an attempt whose outcome is unknown it returns an error
// rather than sending the renewal again (see WithRetries).
//
// On a pool of one connection (sql.DB.SetMaxOpenConns(1)) it fails at
// once, renewing nothing, while a CompleteTx transaction of the backend
// holds that connection: a renewal would wait for the transaction to end.
// Under idempotency.WithHeartbeat that is every renewal while the body
// runs: the heartbeat logs the error and tries again at its next tick,
// the body's commit is not held up, and the lease is not renewed. Give
// such a pool more connections than there are transactional deliveries
// at once. On a larger pool a renewal waits for a free connection.
func (b *Backend) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return c, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return c, err
	}
	if err := b.renewable(c); err != nil {
		return c, err
	}
	k := []byte(c.Key)
	var until int64
	var held bool
	// An attempt that may have renewed the lease without its reply arriving
	// is not sent again: a resend would renew it once more, from a later
	// instant (one call, two extensions). The call then returns an error and
	// the caller renews again later (the heartbeat does, at its next tick).
	err := b.retry(ctx, func() error {
		if b.q.Returning {
			err := b.queryRow(ctx, b.q.Extend, []any{k, c.Fence, millis(lease), millis(b.ttl), c.Token}, &until)
			if errors.Is(err, sql.ErrNoRows) {
				held = false
				return nil
			}
			held = err == nil
			if err != nil && mayHaveLanded(err) && !neverSent(err) {
				return fmt.Errorf("%w: %w", errNoResend, err)
			}
			return err
		}
		if _, err := b.exec(ctx, b.q.Extend, millis(lease), millis(lease), millis(b.ttl), k, c.Fence, c.Token); err != nil {
			if mayHaveLanded(err) && !neverSent(err) {
				return fmt.Errorf("%w: %w", errNoResend, err)
			}
			return err
		}
		err := b.queryRow(ctx, b.q.Lease, []any{k, c.Fence, c.Token}, &until)
		if errors.Is(err, sql.ErrNoRows) {
			held = false
			return nil
		}
		held = err == nil
		if err != nil {
			// The update ran: reading it back failed.
			return fmt.Errorf("%w: %w", errNoResend, err)
		}
		return nil
	})
	if err != nil {
		return c, fmt.Errorf("sqllock: extend %q fence %d: %w", c.Key, c.Fence, err)
	}
	if !held {
		return c, fmt.Errorf("sqllock: extend %q fence %d: %w", c.Key, c.Fence, store.ErrLost)
	}
	c.LeaseExpiry = time.UnixMilli(until)
	return c, nil
}

// PurgeBatch is how many rows one PurgeExpired statement deletes at most.
const PurgeBatch = dialect.PurgeBatch

// PurgeExpired implements store.Purger: it deletes rows whose
// expires_at_ms has passed by the database's clock, PurgeBatch rows per
// statement, until none are left or limit rows are gone.
func (b *Backend) PurgeExpired(ctx context.Context, limit int) (int, error) {
	total, err := dialect.Purge(limit, func(n int) (int64, error) {
		var deleted int64
		err := b.retry(ctx, func() error {
			var err error
			deleted, err = b.exec(ctx, b.q.Purge, n)
			return err
		})
		return deleted, err
	})
	if err != nil {
		return total, fmt.Errorf("sqllock: purge: %w", err)
	}
	return total, nil
}
