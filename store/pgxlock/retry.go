package pgxlock

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/gcp-pubsub-idempotency/idempotency/store/internal/dialect"
)

// transient reports whether a retry may clear err: a connection that broke
// or was never made, a serialization failure, a deadlock, a lock not
// available, or a server shutting down or starting.
func transient(err error) bool {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		switch pg.Code {
		case "40001", "40P01", "55P03", "57P01", "57P02", "57P03", "08000", "08003", "08006":
			return true
		}
		return false
	}
	if pgconn.SafeToRetry(err) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	var ne net.Error
	if errors.As(err, &ne) {
		return true
	}
	msg := err.Error()
	for _, s := range []string{"conn closed", "broken pipe", "connection reset", "unexpected EOF"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// mayHaveLanded reports whether the write that failed with err may have
// been applied all the same: true unless the server itself refused the
// statement (a single statement outside a transaction that failed changed
// nothing), pgx reports that it sent nothing (pgconn.SafeToRetry), or the
// pool could not make the connection to send it on (pgconn.ConnectError).
func mayHaveLanded(err error) bool {
	var pg *pgconn.PgError
	var ce *pgconn.ConnectError
	return !errors.As(err, &pg) && !errors.As(err, &ce) && !pgconn.SafeToRetry(err)
}

// errNoResend ends an Extend's retries: the attempt may have renewed the
// lease although its reply was lost, and a resend would renew it again.
var errNoResend = errors.New("pgxlock: the extension may have been applied; not sent again")

// retry runs op, and again after a transient failure, within ctx and the
// retry budget (WithRetries), waiting the jittered backoff between
// attempts.
func (b *Backend) retry(ctx context.Context, op func() error) error {
	return b.backoff.Do(ctx, func(int) error { return op() }, retryable)
}

// retryable reports whether an attempt that failed with err may be sent
// again.
func retryable(err error) bool {
	return transient(err) && !errors.Is(err, dialect.ErrUnknownOutcome) && !errors.Is(err, errNoResend) && !errors.Is(err, dialect.ErrCompleteUnknown)
}
