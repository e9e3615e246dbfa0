package orders_test

import (
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/function_example/orders"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

func TestSetupReadsTheLeaseAndFallsBackToMemory(t *testing.T) {
	t.Setenv("GOOGLE_CLOUD_PROJECT", "")
	t.Setenv("DATASTORE_PROJECT_ID", "")
	for v, want := range map[string]time.Duration{"": store.DefaultLease, "90s": 90 * time.Second} {
		t.Setenv("IDEMPOTENCY_LEASE", v)
		b, lease, err := orders.Setup(t.Context())
		if err != nil || lease != want {
			t.Fatalf("IDEMPOTENCY_LEASE=%q: lease %v, %v; want %v", v, lease, err, want)
		}
		if _, ok := b.(*fake.Store); !ok {
			t.Fatalf("backend %T without a project, want the in-memory store", b)
		}
	}
	for _, bad := range []string{"soon", "-1s", "0"} {
		t.Setenv("IDEMPOTENCY_LEASE", bad)
		if _, _, err := orders.Setup(t.Context()); err == nil {
			t.Errorf("IDEMPOTENCY_LEASE=%q accepted", bad)
		}
	}
}
