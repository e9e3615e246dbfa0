package pgxlock

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/gcp-pubsub-idempotency/idempotency/store/internal/dialect"
)

// sentNothing is an error pgx marks safe to retry: nothing was sent.
type sentNothing struct{}

func (sentNothing) Error() string     { return "dial: connection refused" }
func (sentNothing) SafeToRetry() bool { return true }

// The classification of pgx's errors: which attempts are sent again
// (transient), and which failed writes may have landed all the same.
func TestErrorsAreClassifiedForRetriesAndLostReplies(t *testing.T) {
	pg := func(code string) error { return &pgconn.PgError{Severity: "ERROR", Code: code} }
	cut := &net.OpError{Op: "read", Net: "tcp", Err: errors.New("connection reset by peer")}
	for _, c := range []struct {
		name              string
		err               error
		transient, landed bool
	}{
		{"serialization failure", pg("40001"), true, false},
		{"deadlock", pg("40P01"), true, false},
		{"admin shutdown", pg("57P01"), true, false},
		{"unique violation", pg("23505"), false, false},
		{"undefined column", pg("42703"), false, false},
		{"nothing sent", sentNothing{}, true, false},
		{"reply cut", fmt.Errorf("read: %w", cut), true, true},
		{"unexpected EOF", fmt.Errorf("receive message: %w", io.ErrUnexpectedEOF), true, true},
		{"conn closed", errors.New("conn closed"), true, true},
		{"cancelled", fmt.Errorf("timeout: %w", context.Canceled), false, true},
		{"deadline", context.DeadlineExceeded, false, true},
	} {
		if got := transient(c.err); got != c.transient {
			t.Errorf("%s: transient = %v, want %v", c.name, got, c.transient)
		}
		if got := mayHaveLanded(c.err); got != c.landed {
			t.Errorf("%s: mayHaveLanded = %v, want %v", c.name, got, c.landed)
		}
	}
	for _, stop := range []error{dialect.ErrUnknownOutcome, errNoResend, dialect.ErrCompleteUnknown} {
		if retryable(fmt.Errorf("%w: %w", stop, io.EOF)) {
			t.Errorf("%v is retried", stop)
		}
	}
}
