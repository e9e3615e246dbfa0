package sqllock

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"regexp"
	"strings"

	"github.com/gcp-pubsub-idempotency/idempotency/store/internal/dialect"
)

// transient reports whether a retry may clear err.
func transient(err error) bool {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	if errors.Is(err, driver.ErrBadConn) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, sql.ErrConnDone) {
		return true
	}
	var ne net.Error
	if errors.As(err, &ne) {
		return true
	}
	var pg interface{ SQLState() string }
	if errors.As(err, &pg) {
		switch pg.SQLState() {
		case "40001", "40P01", "55P03", "57P01", "57P02", "57P03", "08000", "08003", "08006":
			return true
		}
	}
	var lite interface{ Code() int }
	if errors.As(err, &lite) {
		switch lite.Code() & 0xff {
		case 5, 6: // SQLITE_BUSY, SQLITE_LOCKED
			return true
		}
	}
	msg := err.Error()
	for _, s := range []string{"Error 1213", "Error 1205", "Error 2006", "Error 2013", "invalid connection", "broken pipe", "connection reset"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// errUnknownOutcome and errCompleteUnknown end a Claim's and a
// Complete's retries when a lost reply leaves the outcome unknown.
var (
	errUnknownOutcome  = dialect.ErrUnknownOutcome
	errCompleteUnknown = dialect.ErrCompleteUnknown
)

// errNoResend ends an Extend's retries: the attempt may have renewed the
// lease although its reply was lost, and a resend would renew it again.
var errNoResend = errors.New("sqllock: the extension may have been applied; not sent again")

// neverSent reports whether err says that no connection was made, so that
// the statement cannot have reached the server: a failed dial.
func neverSent(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// mayHaveLanded reports whether the write that failed with err may have
// been applied all the same: true unless the server itself refused the
// statement (an SQLSTATE, a MySQL error number, an SQLite code; a single
// statement outside a transaction that failed changed nothing) or the
// driver reported that it sent nothing (driver.ErrBadConn).
func mayHaveLanded(err error) bool {
	if errors.Is(err, driver.ErrBadConn) {
		return false
	}
	var pg interface{ SQLState() string }
	if errors.As(err, &pg) {
		return false
	}
	var lite interface{ Code() int }
	if errors.As(err, &lite) {
		return false
	}
	return !mysqlServerError.MatchString(err.Error())
}

// mysqlServerError matches go-sql-driver/mysql's rendering of an error the
// server sent ("Error 1213 (40001): ..."); client-side errors such as 2006
// and 2013 (the server went away, the connection was lost) are the ones
// whose write may have landed.
var mysqlServerError = regexp.MustCompile(`(^|: )Error [134]\d{3}\b`)

// retry runs op, and again after a transient failure, within ctx and the
// retry budget (WithRetries), waiting the shared jittered backoff between
// attempts. A Claim's errUnknownOutcome, a Complete's errCompleteUnknown
// and an Extend's errNoResend are never retried. When ctx ends
// before op succeeds, the error wraps ctx.Err() and the last attempt's.
func (b *Backend) retry(ctx context.Context, op func() error) error {
	return b.backoff.Do(ctx, func(int) error { return op() }, retryable)
}

// retryable reports whether an attempt that failed with err may be sent
// again.
func retryable(err error) bool {
	return transient(err) && !errors.Is(err, errUnknownOutcome) && !errors.Is(err, errNoResend) && !errors.Is(err, errCompleteUnknown)
}
