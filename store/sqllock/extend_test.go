package sqllock

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// flaky is a database/sql driver whose every statement is prepared, and
// whose statements containing match fail with err when run (after being
// counted); the rest fail too, with a server refusal.
type flaky struct {
	match string
	err   error
	runs  atomic.Int64
}

func (f *flaky) Connect(context.Context) (driver.Conn, error) { return flakyConn{f}, nil }
func (f *flaky) Driver() driver.Driver                        { return f }
func (f *flaky) Open(string) (driver.Conn, error)             { return flakyConn{f}, nil }

type flakyConn struct{ f *flaky }

func (c flakyConn) Prepare(q string) (driver.Stmt, error) { return flakyStmt{c.f, q}, nil }
func (c flakyConn) Close() error                          { return nil }
func (c flakyConn) Begin() (driver.Tx, error)             { return nil, errors.New("no transactions") }

type flakyStmt struct {
	f *flaky
	q string
}

func (s flakyStmt) Close() error  { return nil }
func (s flakyStmt) NumInput() int { return -1 }
func (s flakyStmt) run() error {
	if strings.Contains(s.q, s.f.match) {
		s.f.runs.Add(1)
		return s.f.err
	}
	return sqlStateErr("XX000")
}
func (s flakyStmt) Exec([]driver.Value) (driver.Result, error) { return nil, s.run() }
func (s flakyStmt) Query([]driver.Value) (driver.Rows, error)  { return nil, s.run() }

// An Extend whose attempt may have renewed the lease without its reply
// arriving is not sent again: one call renews a lease at most once. (A
// resend renewed it again from a later instant, and the history check
// found one Extend call taking effect three times.) An attempt the server
// refused, or one that never reached it (a failed dial), is still retried
// within the budget.
func TestExtendIsNotResentAfterAnAttemptThatMayHaveLanded(t *testing.T) {
	claim := store.Claim{Key: "k", Fence: 1, Token: "t", LeaseExpiry: time.Now().Add(time.Minute)}
	for _, d := range []Dialect{Postgres, MySQL, SQLite} {
		for _, c := range []struct {
			name string
			err  error
			runs int64
		}{
			{"lost reply", io.ErrUnexpectedEOF, 1},
			{"connection reset", errors.New("read tcp: connection reset by peer"), 1},
			{"server refused (serialization failure)", sqlStateErr("40001"), 4},
			{"dial refused (nothing sent)", &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}, 4},
		} {
			f := &flaky{match: "lease_expiry_ms = ", err: c.err}
			db := sql.OpenDB(f)
			t.Cleanup(func() { db.Close() })
			b, err := New(db, d, WithRetries(3))
			if err != nil {
				t.Fatal(err)
			}
			_, err = b.Extend(t.Context(), claim, time.Minute)
			if err == nil || errors.Is(err, store.ErrLost) {
				t.Errorf("%v, %s: Extend = %v, want an error that is not ErrLost", d, c.name, err)
			}
			if !errors.Is(err, c.err) {
				t.Errorf("%v, %s: %v does not wrap the attempt's error", d, c.name, err)
			}
			if got := f.runs.Load(); got != c.runs {
				t.Errorf("%v, %s: the extension was sent %d times, want %d", d, c.name, got, c.runs)
			}
		}
	}
}
