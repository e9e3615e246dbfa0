package doclock

import (
	"errors"
	"fmt"
	"reflect"
)

// The errors of a backend's New, which wraps them after its package's
// name (datastorelock: nil gRPC connection passed to New).
var (
	ErrNilConn       = errors.New("nil gRPC connection")
	ErrNoProject     = errors.New("no project ID")
	ErrClientOptions = errors.New("WithClientOptions configures the connection Dial opens; New does not dial")
)

// CheckNew returns the error of backend name's New for conn (a
// grpc.ClientConnInterface), project and whether WithClientOptions was
// given; nil when they are fine. conn must not be nil, nor a nil pointer
// (a typed nil *grpc.ClientConn, which would fail only at the first
// call); project must be set, as New reads none from the environment;
// and New does not dial, so it cannot honour WithClientOptions.
func CheckNew(name string, conn any, project string, clientOptions bool) error {
	if r := reflect.ValueOf(conn); conn == nil || r.Kind() == reflect.Pointer && r.IsNil() {
		return fmt.Errorf("%s: %w passed to New", name, ErrNilConn)
	}
	if project == "" {
		return fmt.Errorf("%s: %w passed to New (New reads none from the environment; Dial does)", name, ErrNoProject)
	}
	if clientOptions {
		return fmt.Errorf("%s: %w: configure the connection you pass to New instead", name, ErrClientOptions)
	}
	return nil
}

// The gRPC status codes the backends' policies name (google.golang.org/grpc/codes,
// which this module does not depend on).
const (
	codeDeadlineExceeded   = 4
	codeNotFound           = 5
	codeAlreadyExists      = 6
	codePermissionDenied   = 7
	codeResourceExhausted  = 8
	codeFailedPrecondition = 9
	codeAborted            = 10
	codeOutOfRange         = 11
	codeUnimplemented      = 12
	codeInternal           = 13
	codeUnavailable        = 14
	codeInvalidArgument    = 3
	codeUnauthenticated    = 16
)

// Retryable reports whether an RPC that failed with gRPC status code
// code is sent again: Unavailable, Aborted, ResourceExhausted and
// Internal, and DeadlineExceeded, which there is a per-call deadline of
// the transport (when the caller's context itself has ended, the retries
// stop before asking).
func Retryable(code uint32) bool {
	switch code {
	case codeUnavailable, codeAborted, codeResourceExhausted, codeInternal, codeDeadlineExceeded:
		return true
	}
	return false
}

// MayHaveApplied reports whether a Commit that failed with gRPC status
// code code may have been applied all the same (its reply was lost, or
// the call was cut): every code but those the service answers before it
// applies anything.
func MayHaveApplied(code uint32) bool {
	switch code {
	case codeAlreadyExists, codeNotFound, codeInvalidArgument, codeFailedPrecondition,
		codePermissionDenied, codeUnauthenticated, codeOutOfRange, codeUnimplemented:
		return false
	}
	return true
}
