package enginetest

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/stdlib"
	"modernc.org/sqlite"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/internal/dialect"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// engine opens databases of one kind for the tests.
type engine struct {
	name    string
	dialect sqllock.Dialect
	// sql is the dialect's SQL, for the tests that evaluate its parts.
	sql func() *dialect.SQL
	// dsn returns a data source name for a fresh or shared database.
	dsn func(t testing.TB) string
	drv driver.Driver
}

var engines = []engine{
	{"postgres", sqllock.Postgres, dialect.Postgres, func(t testing.TB) string { return testsvc.Postgres(t) }, &stdlib.Driver{}},
	{"mysql", sqllock.MySQL, dialect.MySQL, mariaDSN, &mysql.MySQLDriver{}},
	{"sqlite", sqllock.SQLite, dialect.SQLite, sqliteDSN, &sqlite.Driver{}},
}

// The networked engines, and each engine by name.
var (
	networked         = engines[:2]
	postgres, mariadb = engines[0], engines[1]
	sqliteEngine      = engines[2]
)

// eachEngine runs test as a subtest of t for each of engines.
func eachEngine(t *testing.T, engines []engine, test func(t *testing.T, e engine)) {
	t.Helper()
	for _, e := range engines {
		t.Run(e.name, func(t *testing.T) { test(t, e) })
	}
}

// mariaDSN returns a DSN for the database idem_test on the shared MariaDB.
func mariaDSN(t testing.TB) string {
	return createDatabase(t, testsvc.MariaDB(t), "idem_test")
}

// createDatabase creates the database name, if it is not there yet, on the
// MariaDB server whose DSN (ending in "/") is base, and returns the DSN of
// that database.
func createDatabase(t testing.TB, base, name string) string {
	t.Helper()
	db, err := sql.Open("mysql", base)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec("CREATE DATABASE IF NOT EXISTS " + name); err != nil {
		t.Fatal(err)
	}
	return base + name
}

// sqliteDSN returns a DSN for a new database file.
func sqliteDSN(t testing.TB) string {
	return "file:" + filepath.Join(t.TempDir(), "idem.db") + "?_pragma=busy_timeout(20000)&_pragma=journal_mode(WAL)&_pragma=synchronous(NORMAL)"
}

// counter counts the statements sent through databases opened with it
// (n), and separately the prepares, which a connection does once per
// statement. onPrepare and onConnect, when set, run before each prepare
// and each new connection (a test's hooks to delay or fail one).
type counter struct {
	n, prepares atomic.Int64
	onPrepare   atomic.Pointer[func(ctx context.Context, q string) error]
	onConnect   atomic.Pointer[func(ctx context.Context) error]
	// afterExec, when set, runs after each prepared statement's exec
	// returns, with the statement's text.
	afterExec atomic.Pointer[func(q string)]
	// beforeQuery, when set, runs before each prepared statement's query
	// is sent, with the statement's text.
	beforeQuery atomic.Pointer[func(q string)]
	// beforeCommit, when set, runs before each transaction's commit is
	// sent: the driver's Commit, or a COMMIT statement (CompleteTx sends
	// one on MySQL, to bound the commit by its ctx).
	beforeCommit atomic.Pointer[func()]
	// loseReply, when set, makes the next prepared statement run and
	// then fail as if its reply were lost (sqliteFaults).
	loseReply atomic.Bool
	// loseExecReply is loseReply for the next exec only (a write without
	// RETURNING), letting queries through.
	loseExecReply atomic.Bool
	// cuts counts sqliteFaults.CutConnections: a connection opened before
	// the last cut fails its next statement, unsent, and is discarded.
	cuts atomic.Int64
}

// errLostReply is the error of a statement whose reply sqliteFaults lost:
// a network error, as a driver reports a connection lost mid-call.
var errLostReply error = &net.OpError{Op: "read", Net: "tcp", Err: errors.New("sqliteFaults: reply lost after the statement ran")}

// sqliteFaults is storetest.Faults for an SQLite database opened with its
// counter: SQLite runs in this process, with no connection to a server to
// break, so its driver is made to behave as a lost connection would.
// LoseNextReply lets the next prepared statement run to completion (an
// exec applied, a query's rows all read) and then fails it with a
// network error, so the backend cannot know whether it landed.
// CutConnections fails every open connection's next statement, before it
// runs, and has the pool discard the connection.
type sqliteFaults struct{ c *counter }

// LoseNextReply implements storetest.Faults.
func (f sqliteFaults) LoseNextReply() { f.c.loseReply.Store(true) }

// CutConnections implements storetest.Faults.
func (f sqliteFaults) CutConnections() { f.c.cuts.Add(1) }

// open opens a database of the engine, counting statements into c (which
// may be nil), and closes it when t ends.
func (e engine) open(t testing.TB, dsn string, c *counter) *sql.DB {
	t.Helper()
	if c == nil {
		c = &counter{}
	}
	db := sql.OpenDB(&countingConnector{dsn: dsn, drv: e.drv, c: c})
	db.SetMaxOpenConns(64)
	db.SetMaxIdleConns(64)
	t.Cleanup(func() { db.Close() })
	return db
}

// fresh opens a database of the engine (a shared one for the servers, a new
// file for SQLite), counting statements into c (which may be nil), and
// returns it with a backend on its own new table in it.
func (e engine) fresh(t testing.TB, c *counter, opts ...sqllock.Option) (*sql.DB, *sqllock.Backend) {
	t.Helper()
	db := e.open(t, e.dsn(t), c)
	return db, e.backend(t, db, opts...)
}

// backend returns a backend on its own new table.
func (e engine) backend(t testing.TB, db *sql.DB, opts ...sqllock.Option) *sqllock.Backend {
	t.Helper()
	table := fmt.Sprintf("t_%016x", rand.Uint64())
	b, err := sqllock.New(db, e.dialect, append([]sqllock.Option{sqllock.WithTable(table)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.EnsureSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return b
}

type countingConnector struct {
	dsn string
	drv driver.Driver
	c   *counter
}

func (cc *countingConnector) Connect(ctx context.Context) (driver.Conn, error) {
	if hook := cc.c.onConnect.Load(); hook != nil {
		if err := (*hook)(ctx); err != nil {
			return nil, err
		}
	}
	var conn driver.Conn
	var err error
	if dc, ok := cc.drv.(driver.DriverContext); ok {
		var ctr driver.Connector
		if ctr, err = dc.OpenConnector(cc.dsn); err != nil {
			return nil, err
		}
		conn, err = ctr.Connect(ctx)
	} else {
		conn, err = cc.drv.Open(cc.dsn)
	}
	if err != nil {
		return nil, err
	}
	return &countingConn{Conn: conn, c: cc.c, epoch: cc.c.cuts.Load()}, nil
}

func (cc *countingConnector) Driver() driver.Driver { return cc.drv }

// countingConn forwards to the driver's connection, counting each query
// and exec as one round trip.
type countingConn struct {
	driver.Conn
	c *counter
	// epoch is c.cuts when the connection was opened.
	epoch int64
}

// cut reports whether the connection was cut (sqliteFaults) since it was
// opened.
func (c *countingConn) cut() bool { return c.c.cuts.Load() != c.epoch }

func (c *countingConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	c.c.n.Add(1)
	return c.Conn.(driver.QueryerContext).QueryContext(ctx, q, args)
}

func (c *countingConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	c.c.n.Add(1)
	if hook := c.c.beforeCommit.Load(); hook != nil && strings.EqualFold(q, "COMMIT") {
		(*hook)()
	}
	return c.Conn.(driver.ExecerContext).ExecContext(ctx, q, args)
}

func (c *countingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	tx, err := c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &countingTx{Tx: tx, c: c.c}, nil
}

// countingTx forwards to the driver's transaction, running the counter's
// beforeCommit hook.
type countingTx struct {
	driver.Tx
	c *counter
}

func (tx *countingTx) Commit() error {
	if hook := tx.c.beforeCommit.Load(); hook != nil {
		(*hook)()
	}
	return tx.Tx.Commit()
}

// PrepareContext counts a prepare as a round trip, and each execution of
// the prepared statement as another.
func (c *countingConn) PrepareContext(ctx context.Context, q string) (driver.Stmt, error) {
	c.c.prepares.Add(1)
	if hook := c.c.onPrepare.Load(); hook != nil {
		if err := (*hook)(ctx, q); err != nil {
			return nil, err
		}
	}
	st, err := c.Conn.(driver.ConnPrepareContext).PrepareContext(ctx, q)
	if err != nil {
		return nil, err
	}
	return &countingStmt{Stmt: st, c: c.c, q: q, conn: c}, nil
}

type countingStmt struct {
	driver.Stmt
	c    *counter
	q    string
	conn *countingConn
}

func (s *countingStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	s.c.n.Add(1)
	if s.conn.cut() {
		return nil, errLostReply
	}
	res, err := s.Stmt.(driver.StmtExecContext).ExecContext(ctx, args)
	if hook := s.c.afterExec.Load(); hook != nil {
		(*hook)(s.q)
	}
	if err == nil && (s.c.loseReply.CompareAndSwap(true, false) || s.c.loseExecReply.CompareAndSwap(true, false)) {
		return nil, errLostReply
	}
	return res, err
}

func (s *countingStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	s.c.n.Add(1)
	if s.conn.cut() {
		return nil, errLostReply
	}
	if hook := s.c.beforeQuery.Load(); hook != nil {
		(*hook)(s.q)
	}
	rows, err := s.Stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
	if err == nil && s.c.loseReply.CompareAndSwap(true, false) {
		// Run the statement to its end (a write with RETURNING applies
		// as its rows are read), then lose what it returned.
		dest := make([]driver.Value, len(rows.Columns()))
		for rows.Next(dest) == nil {
		}
		rows.Close()
		return nil, errLostReply
	}
	return rows, err
}

func (s *countingStmt) CheckNamedValue(nv *driver.NamedValue) error {
	if ch, ok := s.Stmt.(driver.NamedValueChecker); ok {
		return ch.CheckNamedValue(nv)
	}
	return driver.ErrSkip
}

func (c *countingConn) ResetSession(ctx context.Context) error {
	if r, ok := c.Conn.(driver.SessionResetter); ok {
		return r.ResetSession(ctx)
	}
	return nil
}

func (c *countingConn) IsValid() bool {
	if c.cut() {
		return false
	}
	if v, ok := c.Conn.(driver.Validator); ok {
		return v.IsValid()
	}
	return true
}

func (c *countingConn) CheckNamedValue(nv *driver.NamedValue) error {
	if ch, ok := c.Conn.(driver.NamedValueChecker); ok {
		return ch.CheckNamedValue(nv)
	}
	return driver.ErrSkip
}
