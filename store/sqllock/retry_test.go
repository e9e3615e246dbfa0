package sqllock

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
)

type sqlStateErr string

func (e sqlStateErr) Error() string    { return "server said " + string(e) }
func (e sqlStateErr) SQLState() string { return string(e) }

type sqliteErr int

func (e sqliteErr) Error() string { return fmt.Sprintf("sqlite error %d", int(e)) }
func (e sqliteErr) Code() int     { return int(e) }

// What a retry may clear, and what it may not: the classification the
// shared backoff loop is given. A Claim that lost a reply and then found
// the record moved on (errUnknownOutcome) is never retried, whatever the
// error it wraps.
func TestRetryable(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}, true},
		{io.EOF, true},
		{io.ErrUnexpectedEOF, true},
		{driver.ErrBadConn, true},
		{sqlStateErr("40001"), true}, // serialization failure
		{sqlStateErr("40P01"), true}, // deadlock
		{sqlStateErr("57P01"), true}, // admin shutdown
		{sqlStateErr("23505"), false},
		{sqlStateErr("42P01"), false},
		{sqliteErr(5), true},       // SQLITE_BUSY
		{sqliteErr(5 | 256), true}, // SQLITE_BUSY_RECOVERY
		{sqliteErr(6), true},       // SQLITE_LOCKED
		{sqliteErr(19), false},     // SQLITE_CONSTRAINT
		{errors.New("Error 1213 (40001): Deadlock found when trying to get lock"), true},
		{errors.New("Error 1205 (HY000): Lock wait timeout exceeded"), true},
		{errors.New("invalid connection"), true},
		{errors.New("Error 1062 (23000): Duplicate entry"), false},
		{context.Canceled, false},
		{fmt.Errorf("dial: %w", context.DeadlineExceeded), false},
		{fmt.Errorf("%w: %w", errUnknownOutcome, io.ErrUnexpectedEOF), false},
		{fmt.Errorf("claim: %w", fmt.Errorf("%w: it moved on", errUnknownOutcome)), false},
		{fmt.Errorf("%w: %w", errNoResend, io.ErrUnexpectedEOF), false},
		{fmt.Errorf("%w: %w", errCompleteUnknown, io.ErrUnexpectedEOF), false},
	} {
		if got := retryable(c.err); got != c.want {
			t.Errorf("retryable(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

func TestMayHaveLanded(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{io.ErrUnexpectedEOF, true},
		{errors.New("invalid connection"), true},
		{fmt.Errorf("write: %w", errors.New("broken pipe")), true},
		{driver.ErrBadConn, false},
		{sqlStateErr("40P01"), false},
		{fmt.Errorf("wrapped: %w", sqlStateErr("40001")), false},
		{errors.New("Error 1213 (40001): Deadlock found when trying to get lock"), false},
		{errors.New("Error 1205 (HY000): Lock wait timeout exceeded"), false},
		{errors.New("Error 4031 (HY000): The client was disconnected by the server"), false},
	} {
		if got := mayHaveLanded(c.err); got != c.want {
			t.Errorf("mayHaveLanded(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

// Which failures run a CompleteTx's whole transaction again, body
// included: those that rolled the transaction back because of a
// concurrent one (serialization failure, deadlock, MariaDB's "record has
// changed" under snapshot isolation, a busy or locked SQLite database),
// wrapped or not; never a broken connection, a constraint, a cancelled
// ctx, nor an SQLite commit that failed (its transaction may still be
// open on the connection).
func TestRetryTx(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{sqlStateErr("40001"), true},
		{fmt.Errorf("body: %w", sqlStateErr("40001")), true},
		{sqlStateErr("40P01"), true},
		{sqlStateErr("55P03"), false}, // lock not available: not a rollback
		{sqlStateErr("23505"), false},
		{sqlStateErr("57P01"), false},
		{errors.New("Error 1213 (40001): Deadlock found when trying to get lock"), true},
		{fmt.Errorf("body: %w", errors.New("Error 1213 (40001): Deadlock found when trying to get lock")), true},
		{errors.New("Error 1020 (HY000): Record has changed since last read in table 't'"), true},
		{errors.New("Error 1205 (HY000): Lock wait timeout exceeded"), false},
		{errors.New("Error 1062 (23000): Duplicate entry"), false},
		{errors.New("my Error 1213x"), false},
		{sqliteErr(5), true},
		{sqliteErr(5 | 512), true}, // SQLITE_BUSY_SNAPSHOT
		{sqliteErr(6), true},
		{sqliteErr(19), false},
		{fmt.Errorf("commit: %w", fmt.Errorf("%w: %w", errCommitRefused, sqliteErr(5))), false},
		{io.ErrUnexpectedEOF, false},
		{driver.ErrBadConn, false},
		{errors.New("invalid connection"), false},
		{context.Canceled, false},
	} {
		if got := retryTx(c.err); got != c.want {
			t.Errorf("retryTx(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
