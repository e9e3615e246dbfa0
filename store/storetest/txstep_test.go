package storetest_test

import (
	"runtime"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// RunTx passes a correct backend whose harness Step is below
// idempotency.MinLease (any positive Step with TTL >= 10 Steps is valid):
// the cases give LockTx a lease it takes. Found in review of 7eaf3e7,
// whose superseded case then hung until the test binary's timeout.
func TestRunTxWithAStepBelowMinLease(t *testing.T) {
	watchdog := time.AfterFunc(30*time.Second, func() {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		panic("the superseded rule is still blocked after 30s with Step 20ms (LockTx refused the lease; nobody sends on s.won):\n" + string(buf))
	})
	t.Cleanup(func() { watchdog.Stop() })
	storetest.RunTx(t, func(t *testing.T) storetest.TxHarness[*rowTx] {
		s := fake.New(fake.WithTTL(time.Second))
		db := &rowDB{rows: map[string]int{}, locked: map[string]bool{}}
		m := &txMutant{Store: s, db: db} // the mutant with no bug
		return db.harness(storetest.Harness{Backend: m, TTL: time.Second, Step: 20 * time.Millisecond, Faults: m})
	})
}
