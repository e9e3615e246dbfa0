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
//	Postgres    1 / 1 / 1                         1          1
//	SQLite      1 / 2 / 1                         1          1
//	MySQL       2 / 2 / 3                         1 (2 if repeated)   1
//
// The table (see Schema for the exact DDL of each dialect):
//
//	idem_key         the key, as bytes (BYTEA / VARBINARY(1024) / BLOB), primary key
//	state            1 claimed, 2 done
//	fence            the fencing token
//	lease_expiry_ms  when the holder's lease ends, Unix milliseconds
//	expires_at_ms    when the record may be deleted, Unix milliseconds (indexed)
//	token            the winning claim's token
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
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/retry"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock/internal/dialect"
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
// a claimed record outlives its lease. Default store.DefaultTTL.
func WithTTL(ttl time.Duration) Option { return func(b *Backend) { b.ttl = ttl } }

// WithRetries sets how many more times an operation is sent, with the same
// claim token, after a broken connection, a deadlock, a serialization
// failure or a busy database, waiting a jittered backoff between attempts
// (10ms, doubling up to 320ms). Extend is the exception: an attempt that
// may have renewed the lease without its reply arriving is not sent again
// (a resend would renew it a second time), and Extend returns the error.
// Default 3; negative makes New fail.
func WithRetries(n int) Option { return func(b *Backend) { b.retries = n } }

// Backend is a store.Backend on a SQL table. It is safe for concurrent use.
type Backend struct {
	db      *sql.DB
	table   string
	ttl     time.Duration
	retries int
	q       dialect.Statements
	backoff retry.Policy

	mu       sync.Mutex
	prepared map[string]*preparing
}

var (
	_ store.Backend  = (*Backend)(nil)
	_ store.Extender = (*Backend)(nil)
	_ store.Purger   = (*Backend)(nil)
)

var identifier = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

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
	sq := d.sql()
	if sq == nil {
		return nil, fmt.Errorf("sqllock: %v is not a dialect (use sqllock.Postgres, sqllock.MySQL or sqllock.SQLite)", d)
	}
	parts := strings.Split(b.table, ".")
	if len(parts) > 2 {
		return nil, fmt.Errorf("sqllock: table name %q: at most schema.table", b.table)
	}
	for _, p := range parts {
		if !identifier.MatchString(p) {
			return nil, fmt.Errorf("sqllock: table name %q: %q is not a plain identifier ([A-Za-z_][A-Za-z0-9_]{0,62})", b.table, p)
		}
	}
	if err := store.ValidateTTL(b.ttl); err != nil {
		return nil, fmt.Errorf("sqllock: %w", err)
	}
	if b.retries < 0 {
		return nil, fmt.Errorf("sqllock: retries %d is negative", b.retries)
	}
	b.q = sq.Render(b.table)
	b.backoff = retry.Policy{Retries: b.retries, Base: 10 * time.Millisecond, Max: 320 * time.Millisecond}
	return b, nil
}

// Schema returns the DDL EnsureSchema runs: the table and its index on
// expires_at_ms.
func (b *Backend) Schema() string { return b.q.Schema1 }

// TTL returns the ttl the backend applies.
func (b *Backend) TTL() time.Duration { return b.ttl }

// EnsureSchema creates the table and its index if they do not exist. It is
// safe to call from several instances at once.
func (b *Backend) EnsureSchema(ctx context.Context) error {
	return b.retry(ctx, func() error {
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
		return tx.Commit()
	})
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

func millis(d time.Duration) int64 { return int64((d + time.Millisecond - 1) / time.Millisecond) }

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

type row struct {
	state, fence, lease, exp, now int64
	token                         string
}

func (b *Backend) read(ctx context.Context, key []byte) (r row, found bool, err error) {
	err = b.queryRow(ctx, b.q.Read, []any{key}, &r.state, &r.fence, &r.lease, &r.exp, &r.token, &r.now)
	if errors.Is(err, sql.ErrNoRows) {
		return r, false, nil
	}
	return r, err == nil, err
}

// judge turns a record someone else holds into a Result; ok is false when
// the record is reclaimable (or ours) and needs a write.
func judge(r row, token string) (store.Result, bool) {
	switch {
	case r.state == 1 && r.token == token:
		return store.Result{}, false
	case r.state == 2 && r.now < r.exp:
		return store.Result{Outcome: store.AlreadyDone, Until: time.UnixMilli(r.exp)}, true
	case r.state == 1 && r.now < r.lease:
		return store.Result{Outcome: store.HeldByOther, Until: time.UnixMilli(r.lease)}, true
	}
	return store.Result{}, false
}

// maxRounds bounds how often Claim looks again after losing a race.
const maxRounds = 32

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
	var res store.Result
	// lost is the error of the first attempt whose write may have landed
	// unseen (its reply was lost). From then on only finding the token in
	// the record tells: a retry that finds someone else's record cannot
	// say whether that attempt had won it (and lost it since), so it
	// answers an error, never HeldByOther or AlreadyDone.
	var lost error
	err := b.retry(ctx, func() error {
		for range maxRounds {
			var err error
			switch {
			case b.q.Claim != "":
				res, err = b.claimOne(ctx, k, lease, token)
			case b.q.Upsert != "":
				res, err = b.claimUpsert(ctx, k, lease, token)
			default:
				res, err = b.claimMySQL(ctx, k, lease, token)
			}
			switch {
			case errors.Is(err, errRace):
				continue
			case err != nil:
				if lost == nil && mayHaveLanded(err) {
					lost = err
				}
				return err
			case lost != nil && res.Outcome != store.Won:
				return fmt.Errorf("%w (a retry found the key %v, until %v): %w",
					errUnknownOutcome, res.Outcome, res.Until.UTC().Format(time.RFC3339Nano), lost)
			}
			return nil
		}
		return fmt.Errorf("sqllock: still contended after %d rounds", maxRounds)
	})
	if err != nil {
		return store.Result{}, fmt.Errorf("sqllock: claim %q (outcome unknown: the key may be held until its lease lapses): %w", key, err)
	}
	res.Claim.Key = key
	return res, nil
}

func won(fence, lease int64, token string) store.Result {
	return store.Result{Outcome: store.Won, Claim: store.Claim{Fence: fence, Token: token, LeaseExpiry: time.UnixMilli(lease)}}
}

// claimOne: Postgres, every outcome in one statement.
func (b *Backend) claimOne(ctx context.Context, k []byte, lease time.Duration, token string) (store.Result, error) {
	var outcome, fence, until, now int64
	err := b.queryRow(ctx, b.q.Claim, []any{k, millis(lease), millis(b.ttl), token}, &outcome, &fence, &until, &now)
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
		return store.Result{Outcome: store.AlreadyDone, Until: time.UnixMilli(until)}, nil
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
	if r.state == 1 && r.token == token {
		return won(r.fence, r.lease, token), nil
	}
	return store.Result{}, errRace
}

// claimMySQL: INSERT IGNORE, then read, then a conditional reclaim.
func (b *Backend) claimMySQL(ctx context.Context, k []byte, lease time.Duration, token string) (store.Result, error) {
	lms, tms := millis(lease), millis(b.ttl)
	inserted, err := b.exec(ctx, b.q.Insert, k, lms, lms, tms, token)
	if err != nil {
		return store.Result{}, err
	}
	r, found, err := b.read(ctx, k)
	if err != nil {
		if inserted == 1 {
			// The insert won the key, whatever the read's error says
			// about the read: a retry that finds the key in other hands
			// must not answer their outcome.
			return store.Result{}, fmt.Errorf("%w, then reading it back failed: %w", errInsertWon, err)
		}
		return store.Result{}, err
	}
	if found && r.state == 1 && r.token == token {
		return won(r.fence, r.lease, token), nil
	}
	if inserted == 1 {
		// This call's insert won the key, and its lease lapsed before the
		// read: another caller has taken (or completed) the key since.
		// Answering that caller's outcome would account this call's win
		// to nobody; trying again would win a second fence in one call.
		return store.Result{}, fmt.Errorf("%w: the insert won the key but its lease lapsed and the record moved on before it was read", errUnknownOutcome)
	}
	if !found {
		return store.Result{}, errRace
	}
	if res, ok := judge(r, token); ok {
		return res, nil
	}
	newLease := r.now + lms
	n, err := b.exec(ctx, b.q.Reclaim, newLease, newLease+tms, token, k, r.fence, r.state)
	if err != nil {
		return store.Result{}, err
	}
	if n == 1 {
		return won(r.fence+1, newLease, token), nil
	}
	return store.Result{}, errRace
}

// Complete implements store.Backend.
func (b *Backend) Complete(ctx context.Context, c store.Claim) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	k := []byte(c.Key)
	var done bool
	err := b.retry(ctx, func() error {
		if b.q.Returning {
			var one int
			err := b.queryRow(ctx, b.q.Complete, []any{k, c.Fence, millis(b.ttl), c.Token}, &one)
			if errors.Is(err, sql.ErrNoRows) {
				done = false
				return nil
			}
			done = err == nil
			return err
		}
		n, err := b.exec(ctx, b.q.Complete, millis(b.ttl), k, c.Fence, c.Token)
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
	})
	if err != nil {
		return false, fmt.Errorf("sqllock: complete %q fence %d: %w", c.Key, c.Fence, err)
	}
	return done, nil
}

// Release implements store.Backend.
func (b *Backend) Release(ctx context.Context, c store.Claim) error {
	if err := store.ValidateKey(c.Key); err != nil {
		return err
	}
	k := []byte(c.Key)
	err := b.retry(ctx, func() error {
		var err error
		if b.q.Returning {
			_, err = b.exec(ctx, b.q.Release, k, c.Fence, millis(b.ttl), c.Token)
		} else {
			_, err = b.exec(ctx, b.q.Release, millis(b.ttl), k, c.Fence, c.Token)
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("sqllock: release %q fence %d: %w", c.Key, c.Fence, err)
	}
	return nil
}

// Extend implements store.Extender. It renews the lease at most once per
// call: after an attempt whose outcome is unknown it returns an error
// rather than sending the renewal again (see WithRetries).
func (b *Backend) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return c, err
	}
	if err := store.ValidateLease(lease); err != nil {
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
const PurgeBatch = 1000

// PurgeExpired implements store.Purger: it deletes rows whose
// expires_at_ms has passed by the database's clock, PurgeBatch rows per
// statement, until none are left or limit rows are gone.
func (b *Backend) PurgeExpired(ctx context.Context, limit int) (int, error) {
	total := 0
	for limit <= 0 || total < limit {
		n := PurgeBatch
		if limit > 0 && limit-total < n {
			n = limit - total
		}
		var deleted int64
		err := b.retry(ctx, func() error {
			var err error
			deleted, err = b.exec(ctx, b.q.Purge, n)
			return err
		})
		if err != nil {
			return total, fmt.Errorf("sqllock: purge: %w", err)
		}
		total += int(deleted)
		if deleted < int64(n) {
			break
		}
	}
	return total, nil
}
