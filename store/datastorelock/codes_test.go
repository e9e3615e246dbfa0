package datastorelock_test

import (
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"
)

// doclock names gRPC's status codes by number, without importing gRPC:
// its retry and may-have-applied policies must be the ones these names
// say, code by code.
func TestTheDocumentStoresPoliciesNameGRPCsCodes(t *testing.T) {
	retried := map[codes.Code]bool{codes.Unavailable: true, codes.Aborted: true, codes.ResourceExhausted: true, codes.Internal: true, codes.DeadlineExceeded: true}
	answeredBeforeApplying := map[codes.Code]bool{codes.AlreadyExists: true, codes.NotFound: true, codes.InvalidArgument: true, codes.FailedPrecondition: true,
		codes.PermissionDenied: true, codes.Unauthenticated: true, codes.OutOfRange: true, codes.Unimplemented: true}
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		if got := doclock.Retryable(uint32(c)); got != retried[c] {
			t.Errorf("Retryable(%v) = %v, want %v", c, got, retried[c])
		}
		if got := doclock.MayHaveApplied(uint32(c)); got == answeredBeforeApplying[c] {
			t.Errorf("MayHaveApplied(%v) = %v, want %v", c, got, !answeredBeforeApplying[c])
		}
	}
}
