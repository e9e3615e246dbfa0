package sqllock_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// These tests need no database engine: New does no I/O, and a connection
// that cannot be made is all the retry loop needs to show what it does.
// The tests on PostgreSQL, MariaDB and SQLite are in the module
// store/sqllock/internal/enginetest, which brings their drivers.

// unreachable is a driver.Connector (and driver.Driver) whose every
// connection attempt fails with err, counting the attempts.
type unreachable struct {
	err      error
	attempts atomic.Int64
}

func (u *unreachable) Connect(context.Context) (driver.Conn, error) {
	u.attempts.Add(1)
	return nil, u.err
}

func (u *unreachable) Driver() driver.Driver { return u }

func (u *unreachable) Open(string) (driver.Conn, error) { return u.Connect(context.Background()) }

// dbOf returns a *sql.DB on u, closed when t ends.
func dbOf(t testing.TB, u *unreachable) *sql.DB {
	db := sql.OpenDB(u)
	t.Cleanup(func() { db.Close() })
	return db
}

// noDB returns a *sql.DB that reaches no database.
func noDB(t testing.TB) *sql.DB {
	return dbOf(t, &unreachable{err: errors.New("no database here")})
}

func TestNewRefusesHostileTableNames(t *testing.T) {
	db := noDB(t)
	for _, name := range []string{
		"t; DROP TABLE users; --", `t"x`, "t`x", "t'x", "tàble", "has space", "1starts_with_digit",
		"a.b.c", "", ".t", "t.", strings.Repeat("x", 64),
	} {
		if _, err := sqllock.New(db, sqllock.SQLite, sqllock.WithTable(name)); err == nil {
			t.Errorf("table name %q accepted", name)
		}
	}
	for _, name := range []string{"idempotency_keys", "_t", "Orders2", "app.idempotency_keys", strings.Repeat("x", 63)} {
		if _, err := sqllock.New(db, sqllock.SQLite, sqllock.WithTable(name)); err != nil {
			t.Errorf("table name %q refused: %v", name, err)
		}
	}
	if _, err := sqllock.New(nil, sqllock.SQLite); err == nil {
		t.Error("nil db accepted")
	}
	if _, err := sqllock.New(db, sqllock.SQLite, sqllock.WithTTL(0)); !errors.Is(err, store.ErrInvalidTTL) {
		t.Errorf("ttl 0: %v", err)
	}
	if _, err := sqllock.New(db, sqllock.SQLite, sqllock.WithRetries(-1)); err == nil {
		t.Error("retries -1 accepted")
	}
}

// A Dialect is one of the three constants; the zero Dialect (a field
// nobody set) and any other number make New fail rather than pick an
// engine.
func TestNewRefusesAnythingButTheThreeDialects(t *testing.T) {
	db := noDB(t)
	var unset sqllock.Dialect
	for _, d := range []sqllock.Dialect{unset, -1, 4} {
		if b, err := sqllock.New(db, d); err == nil || b != nil {
			t.Errorf("New(db, %v) = %v, %v; want an error", d, b, err)
		} else if !strings.Contains(err.Error(), d.String()) {
			t.Errorf("New(db, %v): the error %q does not name the dialect", d, err)
		}
	}
	for d, name := range map[sqllock.Dialect]string{sqllock.Postgres: "postgres", sqllock.MySQL: "mysql", sqllock.SQLite: "sqlite"} {
		if d.String() != name {
			t.Errorf("%d.String() = %q, want %q", int(d), d.String(), name)
		}
		b, err := sqllock.New(db, d)
		if err != nil {
			t.Fatalf("New(db, %v): %v", d, err)
		}
		if b.TTL() != store.DefaultTTL || !strings.Contains(b.Schema(), sqllock.DefaultTable) {
			t.Errorf("New(db, %v): ttl %v, schema %q; want the defaults", d, b.TTL(), b.Schema())
		}
	}
}

// The retry budget: a transient failure (here every connection attempt is
// refused) is retried WithRetries(n) times, n+1 attempts in all, and the
// error returned wraps the last attempt's; a failure a retry cannot clear
// is not retried at all.
func TestRetriesTransientFailuresWithinTheBudget(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	for _, c := range []struct {
		err      error
		retries  int
		attempts int64
	}{
		{refused, 0, 1},
		{refused, 1, 2},
		{refused, 3, 4},
		{errors.New("password authentication failed"), 3, 1},
	} {
		u := &unreachable{err: c.err}
		b, err := sqllock.New(dbOf(t, u), sqllock.Postgres, sqllock.WithRetries(c.retries))
		if err != nil {
			t.Fatal(err)
		}
		r, err := b.Claim(t.Context(), "k", time.Minute)
		if err == nil || r.Outcome == store.Won {
			t.Fatalf("%v, retries %d: claim %v %v, want an error", c.err, c.retries, r.Outcome, err)
		}
		if !errors.Is(err, c.err) {
			t.Errorf("%v, retries %d: %v does not wrap the attempt's error", c.err, c.retries, err)
		}
		if got := u.attempts.Load(); got != c.attempts {
			t.Errorf("%v, retries %d: %d attempts, want %d", c.err, c.retries, got, c.attempts)
		}
	}
}

// When ctx ends during the retries, the error wraps both ctx.Err() and the
// last attempt's error, and comes promptly however large the budget.
func TestCtxEndingDuringRetriesIsWrappedWithTheLastError(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	u := &unreachable{err: refused}
	b, err := sqllock.New(dbOf(t, u), sqllock.MySQL, sqllock.WithRetries(1000))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 150*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = b.Release(ctx, store.Claim{Key: "k", Fence: 1, Token: "t"})
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, refused) {
		t.Errorf("release: %v, want an error wrapping context.DeadlineExceeded and the refused dial", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("release returned %v after its 150ms deadline", d)
	}
	if n := u.attempts.Load(); n < 2 {
		t.Errorf("%d attempts in 150ms, want retries", n)
	}
	if _, err := b.Claim(ctx, "k", time.Minute); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("claim after ctx ended: %v, want context.DeadlineExceeded", err)
	}
}

// A read-only transaction could not hold the Done mark: New refuses it,
// and takes any other options.
func TestNewRefusesReadOnlyTxOptions(t *testing.T) {
	db := noDB(t)
	if _, err := sqllock.New(db, sqllock.Postgres, sqllock.WithTxOptions(sql.TxOptions{ReadOnly: true})); err == nil {
		t.Error("a read-only WithTxOptions accepted")
	}
	if _, err := sqllock.New(db, sqllock.Postgres, sqllock.WithTxOptions(sql.TxOptions{Isolation: sql.LevelSerializable})); err != nil {
		t.Errorf("a serializable WithTxOptions refused: %v", err)
	}
}

// CompleteTx checks the key, the fingerprint and body before any I/O: no
// connection is attempted.
func TestCompleteTxValidatesBeforeAnyIO(t *testing.T) {
	u := &unreachable{err: errors.New("no database here")}
	b, err := sqllock.New(dbOf(t, u), sqllock.Postgres)
	if err != nil {
		t.Fatal(err)
	}
	calls := 0
	body := func(context.Context, *sql.Tx) error { calls++; return nil }
	c := store.Claim{Key: "k", Fence: 1, Token: "t"}
	for _, tc := range []struct {
		name string
		c    store.Claim
		fp   string
		body func(context.Context, *sql.Tx) error
		want error
	}{
		{"empty key", store.Claim{Fence: 1, Token: "t"}, "", body, store.ErrInvalidKey},
		{"long key", store.Claim{Key: strings.Repeat("k", store.MaxKeyLen+1), Fence: 1, Token: "t"}, "", body, store.ErrInvalidKey},
		{"bad fingerprint", c, "\xff", body, store.ErrInvalidFingerprint},
		{"long fingerprint", c, strings.Repeat("f", store.MaxFingerprintLen+1), body, store.ErrInvalidFingerprint},
		{"nil body", c, "", nil, nil},
	} {
		ok, err := b.CompleteTx(t.Context(), tc.c, tc.fp, tc.body)
		if ok || err == nil || (tc.want != nil && !errors.Is(err, tc.want)) {
			t.Errorf("%s: %v %v, want an error wrapping %v", tc.name, ok, err, tc.want)
		}
	}
	if n := u.attempts.Load(); n != 0 || calls != 0 {
		t.Errorf("%d connection attempts and %d body calls before the input was refused", n, calls)
	}
}
