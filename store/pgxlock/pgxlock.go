// Package pgxlock is a store.Backend on a PostgreSQL table through pgx's
// own interface (github.com/jackc/pgx/v5): a *pgxpool.Pool (or a
// *pgx.Conn, for calls that never overlap: see DB), and pgx.Tx for
// CompleteTx.
//
// Give the backend to any of the idempotency package's guards: Lock,
// Mutex, Idempotent, PushHandler, and the transactional LockTx,
// IdempotentTx and PushHandlerTx, whose handler receives the pgx.Tx that
// also marks the key done. Code sqlc generates in its pgx/v5 mode runs in
// that transaction through its queries.WithTx(tx), so the handler's rows
// and the mark commit together (Example_sqlcQueriesInLockTx).
//
// It sends the same statements to the same table as package sqllock's
// PostgreSQL dialect (both render them from one source), so a service can
// move from sqllock on database/sql to pgxlock, or back, or run both on
// one table at once, with no migration: a record either one writes, the
// other reads, claims, completes, releases and lists.
//
// Bring your own pool (its size, credentials and settings); the backend
// only runs statements on it. A transaction of CompleteTx holds one of
// its connections while the body runs, and a lease renewal
// (WithHeartbeat) needs another: give the pool more connections than
// there are transactional deliveries at once. Time comes from the database's clock. Keys
// are bound as parameters, never spliced into SQL; the table name is
// checked to be a plain identifier (optionally schema-qualified) and
// quoted. pgx caches each statement's preparation per connection (its
// default QueryExecModeCacheStatement), so the backend prepares nothing
// itself.
//
// Round trips per operation: Claim 1 when the key is fresh, 2 when it is
// taken; Complete 1; Release 1; Extend 1. CompleteTx adds, to the body's
// own statements, a begin, the transaction's marker, one UPDATE and the
// commit. The operations (store.Operator): Inspect one round trip, List
// one per page, ForceRelease and Forget two (a read, then one
// conditional write on the token read).
//
// The table is sqllock's (see Schema):
//
//	idem_key         the key, as bytes (BYTEA), primary key
//	state            1 claimed, 2 done
//	fence            the fencing token
//	lease_expiry_ms  when the holder's lease ends, Unix milliseconds
//	expires_at_ms    when the record may be deleted, Unix milliseconds (indexed)
//	token            the winning claim's token
//	fingerprint      NULL, or the payload fingerprint of the completing call,
//	                 stamped with the fence it completed ("<fence>:<fp>")
//
// Nothing deletes expired rows by itself: call PurgeExpired now and then.
package pgxlock

import (
	"context"
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
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DB is the part of pgx's interface the backend uses, which a
// *pgxpool.Pool and a *pgx.Conn share. A *pgx.Conn is one connection and
// is not safe for concurrent use: give the backend a pool unless its
// calls never overlap (no concurrent deliveries, no WithHeartbeat).
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

var (
	_ DB = (*pgxpool.Pool)(nil)
	_ DB = (*pgx.Conn)(nil)
)

// DefaultTable is the table the backend uses unless WithTable says
// otherwise: sqllock's default, the same table.
const DefaultTable = "idempotency_keys"

// Option configures a Backend.
type Option func(*Backend)

// WithTable sets the table name: an identifier of letters, digits and
// underscores (not starting with a digit, at most 63 characters), or
// schema.table. Anything else makes New fail.
func WithTable(name string) Option { return func(b *Backend) { b.table = name } }

// WithTTL sets how long a completed key suppresses duplicates, and how
// long a claimed record outlives its lease. Default store.DefaultTTL. Any
// positive ttl is honoured, rounded up to a whole millisecond; zero or
// negative makes New fail.
func WithTTL(ttl time.Duration) Option { return func(b *Backend) { b.ttl = ttl } }

// WithRetries sets how many more times an operation is sent, with the
// same claim token, after a broken connection, a deadlock, a
// serialization failure or a server shutting down, waiting a jittered
// backoff between attempts (10ms, doubling up to 320ms). An Extend whose
// renewal may have landed without its reply is not sent again. Default 3;
// negative makes New fail.
func WithRetries(n int) Option { return func(b *Backend) { b.retries = n } }

// WithLogger sets where the backend logs. Default slog.Default().
func WithLogger(l *slog.Logger) Option { return func(b *Backend) { b.logger = l } }

// WithTxOptions sets the options of the transactions CompleteTx begins,
// for example pgx.TxOptions{IsoLevel: pgx.Serializable}. Without it they
// begin with the session's defaults (READ COMMITTED unless the server or
// role says otherwise). A read-only access mode makes New fail (the Done
// mark is a write), and so does an isolation level PostgreSQL does not
// have. At REPEATABLE READ or SERIALIZABLE, a lease renewal
// (WithHeartbeat) that commits while the body runs makes the Done mark's
// UPDATE fail in every attempt: CompleteTx then returns an error wrapping
// ErrSnapshotConflict. Use READ COMMITTED for bodies longer than one
// heartbeat period.
func WithTxOptions(opts pgx.TxOptions) Option { return func(b *Backend) { b.txOpts = opts } }

// Backend is a store.Backend on a PostgreSQL table through pgx. It is safe
// for concurrent use when its DB is (a *pgxpool.Pool is).
type Backend struct {
	db      DB
	table   string
	ttl     time.Duration
	retries int
	txOpts  pgx.TxOptions
	logger  *slog.Logger
	q       dialect.Statements
	backoff retry.Policy
	probe   string // the argument of q.HasFingerprint

	// txConns counts the connections CompleteTx's transactions hold now.
	txConns atomic.Int64
	// single reports a DB of one connection (a *pgx.Conn), which one
	// holds at a time: CompleteTx for the whole of its call, Extend for
	// its statement (a renewal that finds it held fails at once).
	single bool
	one    sync.Mutex
}

var (
	_ store.Backend       = (*Backend)(nil)
	_ store.Extender      = (*Backend)(nil)
	_ store.Purger        = (*Backend)(nil)
	_ store.Fingerprinter = (*Backend)(nil)
)

// New returns a Backend over db (a *pgxpool.Pool or a *pgx.Conn). It does
// no I/O: call EnsureSchema, or create the table yourself from Schema. It
// fails if db is nil (a nil *pgxpool.Pool or *pgx.Conn included) or an
// option's value is invalid.
func New(db DB, opts ...Option) (*Backend, error) {
	b := &Backend{db: db, table: DefaultTable, ttl: store.DefaultTTL, retries: 3}
	for _, o := range opts {
		o(b)
	}
	switch v := db.(type) {
	case nil:
		return nil, errors.New("pgxlock: nil DB")
	case *pgxpool.Pool:
		if v == nil {
			return nil, errors.New("pgxlock: nil *pgxpool.Pool")
		}
	case *pgx.Conn:
		if v == nil {
			return nil, errors.New("pgxlock: nil *pgx.Conn")
		}
		b.single = true
	}
	if b.logger == nil {
		b.logger = slog.Default()
	}
	parts, err := dialect.CheckTable(b.table)
	if err != nil {
		return nil, fmt.Errorf("pgxlock: %w", err)
	}
	if err := store.ValidateTTL(b.ttl); err != nil {
		return nil, fmt.Errorf("pgxlock: %w", err)
	}
	if b.retries < 0 {
		return nil, fmt.Errorf("pgxlock: retries %d is negative", b.retries)
	}
	if b.txOpts.AccessMode == pgx.ReadOnly {
		return nil, errors.New("pgxlock: WithTxOptions: a read-only transaction cannot hold the Done mark")
	}
	switch b.txOpts.IsoLevel {
	case "", pgx.ReadUncommitted, pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable:
	default:
		return nil, fmt.Errorf("pgxlock: WithTxOptions: PostgreSQL has no isolation level %q", b.txOpts.IsoLevel)
	}
	b.q = dialect.Postgres().Render(b.table)
	b.probe = `"` + strings.Join(parts, `"."`) + `"`
	b.backoff = retry.Policy{Retries: b.retries, Base: 10 * time.Millisecond, Max: 320 * time.Millisecond}
	return b, nil
}

// Schema returns the DDL that EnsureSchema runs on a new database: the
// table and its index on expires_at_ms, as sqllock's PostgreSQL dialect
// has them.
func (b *Backend) Schema() string { return b.q.Schema1 }

// UpgradeSchema returns the DDL that adds the fingerprint column to a
// table created by a version of sqllock before the column existed:
// EnsureSchema runs it when the column is missing.
func (b *Backend) UpgradeSchema() string { return b.q.AddFingerprint + ";" }

// TTL returns the ttl the backend applies.
func (b *Backend) TTL() time.Duration { return b.ttl }

// EnsureSchema creates the table and its index if they do not exist, and
// adds the fingerprint column to a table created without it
// (UpgradeSchema); it changes nothing on a table that is up to date. It is
// safe to call from several instances at once, of this package and of
// sqllock: both take the same advisory lock around the DDL.
func (b *Backend) EnsureSchema(ctx context.Context) error {
	return b.retry(ctx, func() error {
		tx, err := b.db.BeginTx(ctx, pgx.TxOptions{})
		if err != nil {
			return err
		}
		defer tx.Rollback(context.WithoutCancel(ctx))
		if _, err := tx.Exec(ctx, b.q.LockDDL); err != nil {
			return err
		}
		for _, q := range b.q.Schema {
			if _, err := tx.Exec(ctx, q); err != nil {
				return fmt.Errorf("pgxlock: %s: %w", firstLine(q), err)
			}
		}
		var n int64
		if err := tx.QueryRow(ctx, b.q.HasFingerprint, b.probe).Scan(&n); err != nil {
			return fmt.Errorf("pgxlock: looking for the fingerprint column: %w", err)
		}
		if n == 0 {
			if _, err := tx.Exec(ctx, b.q.AddFingerprint); err != nil {
				return fmt.Errorf("pgxlock: %s: %w", b.q.AddFingerprint, err)
			}
		}
		return tx.Commit(ctx)
	})
}

// explain adds to err, when it says that the table lacks the fingerprint
// column (SQLSTATE 42703), what to do about it.
func (b *Backend) explain(err error) error {
	var pg *pgconn.PgError
	if errors.As(err, &pg) && pg.Code == "42703" && strings.Contains(pg.Message, "fingerprint") {
		return fmt.Errorf("pgxlock: the table %s has no fingerprint column (it was created by an earlier version of sqllock): call EnsureSchema once, or run %s: %w", b.table, b.UpgradeSchema(), err)
	}
	return err
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return s
}

// millis is d in whole milliseconds, rounded up, the unit of the table's
// instants.
func millis(d time.Duration) int64 { return store.CeilUnits(d, time.Millisecond) }

// row is a record as Read returns it.
type row = dialect.Row

// read reads the record of k on q (the pool, or a transaction).
func (b *Backend) read(ctx context.Context, q DB, k []byte) (r row, found bool, err error) {
	err = q.QueryRow(ctx, b.q.Read, k).Scan(r.Dest()...)
	if errors.Is(err, pgx.ErrNoRows) {
		return r, false, nil
	}
	return r, err == nil, err
}

var errRace = errors.New("pgxlock: the record changed between reading and writing it")

// Claim implements store.Backend.
func (b *Backend) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Result{}, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return store.Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return store.Result{}, fmt.Errorf("pgxlock: claim %q: %w", key, err)
	}
	token := store.NewToken()
	args := []any{[]byte(key), millis(lease), millis(b.ttl), token}
	// dialect.Claim keeps the error of the first attempt whose reply was
	// lost: from then on a retry that finds someone else's record answers
	// an error, never HeldByOther or AlreadyDone.
	res, err := dialect.Claim(func(op func() error) error { return b.retry(ctx, op) }, func() (store.Result, error) {
		return b.claimOnce(ctx, args, token)
	}, errRace, mayHaveLanded)
	if err != nil {
		if missing := b.explain(err); missing != err {
			return store.Result{}, fmt.Errorf("pgxlock: claim %q: %w", key, missing)
		}
		return store.Result{}, fmt.Errorf("pgxlock: claim %q (outcome unknown: the key may be held until its lease lapses): %w", key, err)
	}
	res.Claim.Key = key
	return res, nil
}

func won(fence, lease int64, token string) store.Result {
	return store.Result{Outcome: store.Won, Claim: store.Claim{Fence: fence, Token: token, LeaseExpiry: time.UnixMilli(lease)}}
}

// claimOnce is sqllock's PostgreSQL claim: a plain insert, which wins a
// fresh key; when the key is taken, the full claim, every outcome in one
// statement (it also answers a resend whose insert landed unseen).
func (b *Backend) claimOnce(ctx context.Context, args []any, token string) (store.Result, error) {
	var until int64
	err := b.db.QueryRow(ctx, b.q.ClaimFresh, args...).Scan(&until)
	if err == nil {
		return won(1, until, token), nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return store.Result{}, err
	}
	var outcome, fence, now int64
	var fp *string
	err = b.db.QueryRow(ctx, b.q.Claim, args...).Scan(&outcome, &fence, &until, &now, &fp)
	if errors.Is(err, pgx.ErrNoRows) {
		// A concurrent insert committed after this statement's snapshot.
		return store.Result{}, errRace
	}
	if err != nil {
		return store.Result{}, err
	}
	if outcome == 1 {
		return won(fence, until, token), nil
	}
	if until <= now {
		// The final read saw the statement's snapshot, older than a
		// concurrent reclaim the conflict check found: look again.
		return store.Result{}, errRace
	}
	if outcome == 2 {
		return store.Result{Outcome: store.AlreadyDone, Until: time.UnixMilli(until), Fingerprint: dialect.Unstamp(fp, fence)}, nil
	}
	return store.Result{Outcome: store.HeldByOther, Until: time.UnixMilli(until)}, nil
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
	// dialect.Complete keeps the error of the first attempt that may have
	// completed the record unseen: a later attempt that finds nothing to
	// complete then answers an error, never false.
	done, err := dialect.Complete(func(op func() error) error { return b.retry(ctx, op) }, func() (bool, error) {
		tag, err := b.db.Exec(ctx, b.q.Complete, []byte(c.Key), c.Fence, millis(b.ttl), c.Token, dialect.Stamp(c.Fence, fp))
		return err == nil && tag.RowsAffected() == 1, err
	}, mayHaveLanded)
	if err != nil {
		return false, fmt.Errorf("pgxlock: complete %q fence %d: %w", c.Key, c.Fence, b.explain(err))
	}
	return done, nil
}

// Release implements store.Backend.
func (b *Backend) Release(ctx context.Context, c store.Claim) error {
	if err := store.ValidateKey(c.Key); err != nil {
		return err
	}
	if _, err := b.release(ctx, []byte(c.Key), c.Fence, c.Token); err != nil {
		return fmt.Errorf("pgxlock: release %q fence %d: %w", c.Key, c.Fence, err)
	}
	return nil
}

// release ends the lease of the claim (fence, token) and raises the fence
// if the record k is still Claimed by it, retrying; it reports whether it
// changed the record.
func (b *Backend) release(ctx context.Context, k []byte, fence int64, token string) (bool, error) {
	var n int64
	err := b.retry(ctx, func() error {
		tag, err := b.db.Exec(ctx, b.q.Release, k, fence, millis(b.ttl), token)
		n = tag.RowsAffected()
		return err
	})
	return n == 1, err
}

// renewable fails when a renewal would need the connection a transaction
// of CompleteTx holds: DB is a *pgx.Conn, or a pool of one connection.
func (b *Backend) renewable(c store.Claim) error {
	if b.txConns.Load() == 0 {
		return nil
	}
	if p, ok := b.db.(*pgxpool.Pool); ok && p.Config().MaxConns > 1 {
		return nil
	}
	return b.connHeld(c)
}

// connHeld is Extend's refusal while a transaction of CompleteTx holds
// the backend's only connection.
func (b *Backend) connHeld(c store.Claim) error {
	return fmt.Errorf("pgxlock: extend %q fence %d: cannot renew the lease now: the backend's only connection (a *pgx.Conn, or a pool of MaxConns 1) "+
		"is held by a transaction of CompleteTx, and a renewal needs another; give the backend a pool with more connections "+
		"than there are transactional deliveries at once, or keep the body within its lease", c.Key, c.Fence)
}

// Extend implements store.Extender. It renews the lease at most once per
// call: after an attempt whose outcome is unknown it returns an error
// rather than sending the renewal again. While a transaction of
// CompleteTx holds the backend's only connection (DB a *pgx.Conn, or a
// pool of MaxConns 1) it fails at once and renews nothing; on a
// *pgx.Conn, a CompleteTx that begins while a renewal is in flight waits
// for it to end before it sends its BEGIN.
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
	if b.single {
		// A CompleteTx between its attempts, or one that began since
		// renewable looked, holds the connection, or waits for this
		// renewal to end before it sends its BEGIN.
		if !b.one.TryLock() {
			return c, b.connHeld(c)
		}
		defer b.one.Unlock()
	}
	var until int64
	var held bool
	err := b.retry(ctx, func() error {
		err := b.db.QueryRow(ctx, b.q.Extend, []byte(c.Key), c.Fence, millis(lease), millis(b.ttl), c.Token).Scan(&until)
		if errors.Is(err, pgx.ErrNoRows) {
			held = false
			return nil
		}
		held = err == nil
		if err != nil && mayHaveLanded(err) {
			return fmt.Errorf("%w: %w", errNoResend, err)
		}
		return err
	})
	if err != nil {
		return c, fmt.Errorf("pgxlock: extend %q fence %d: %w", c.Key, c.Fence, err)
	}
	if !held {
		return c, fmt.Errorf("pgxlock: extend %q fence %d: %w", c.Key, c.Fence, store.ErrLost)
	}
	c.LeaseExpiry = time.UnixMilli(until)
	return c, nil
}

// PurgeBatch is how many rows one PurgeExpired statement deletes at most.
const PurgeBatch = dialect.PurgeBatch

// PurgeExpired implements store.Purger: it deletes rows whose
// expires_at_ms has passed by the database's clock, PurgeBatch rows per
// statement, until none are left or limit rows are gone (limit <= 0: no
// limit).
func (b *Backend) PurgeExpired(ctx context.Context, limit int) (int, error) {
	total, err := dialect.Purge(limit, func(n int) (int64, error) {
		var deleted int64
		err := b.retry(ctx, func() error {
			tag, err := b.db.Exec(ctx, b.q.Purge, n)
			deleted = tag.RowsAffected()
			return err
		})
		return deleted, err
	})
	if err != nil {
		return total, fmt.Errorf("pgxlock: purge: %w", err)
	}
	return total, nil
}
