package spannerlock_test

import (
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// The contract suite on the emulator, in real time: Spanner's clock judges
// every lease, so the suite waits instead of moving a clock. Each case has
// a database of its own (the emulator runs one read-write transaction at
// a time per database).
func TestContract(t *testing.T) {
	testsvc.Spanner(t)
	const ttl = 10 * time.Second
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		b, f := contractBackend(t, spannerlock.WithTTL(ttl))
		// The emulator runs one read-write transaction at a time per
		// database, which makes the history case's full 10,000 calls take
		// over ten minutes here: it runs 1,000.
		return storetest.Harness{Backend: b, TTL: ttl, Step: ttl / 10, Faults: f, HistoryOps: 1000}
	})
}
