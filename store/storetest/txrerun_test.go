package storetest_test

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// rerunOnConflict is the correct tx backend of the mutant tests (no bug)
// whose store aborts a transaction, and runs it again, when the claim's
// record was written by someone else while the body ran: optimistic
// concurrency, or the Spanner emulator, which runs one read-write
// transaction per database at a time and aborts the others.
// store.TxCompleter allows it: "It MAY call body more than once".
type rerunOnConflict struct{ *txMutant }

func (r *rerunOnConflict) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(context.Context, *rowTx) error) (bool, error) {
	conflicted := false
	return r.txMutant.CompleteTx(ctx, c, fp, func(ctx context.Context, tx *rowTx) error {
		before, _ := r.Record(c.Key)
		if err := body(ctx, tx); err != nil {
			return err
		}
		if after, _ := r.Record(c.Key); !conflicted && after.Fence != before.Fence {
			conflicted = true
			return errTxRetry // aborted by the other delivery's write: run again
		}
		time.Sleep(50 * time.Millisecond) // the commit's round trip, as on an emulator
		return nil
	})
}

// RunTx passes a correct backend whose store runs the transaction again
// when another delivery wrote the claim's record while the body ran (the
// cases that supersede a claim mid-body start the other delivery once,
// however often the body runs). Found in review of 7eaf3e7, whose
// superseded case deadlocked or raced on such a store.
func TestRunTxOnAStoreThatRerunsTheBodyOnAConflict(t *testing.T) {
	watchdog := time.AfterFunc(60*time.Second, func() {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		panic("the superseded rule is still blocked after 60s on a store that ran the body twice (deadlock):\n" + string(buf))
	})
	t.Cleanup(func() { watchdog.Stop() }) // the cases run in parallel, after this function returns
	storetest.RunTx(t, func(t *testing.T) storetest.TxHarness[*rowTx] {
		clock := fake.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
		s := fake.New(fake.WithClock(clock.Now))
		txMutantClocks.Store(s, clock)
		db := &rowDB{rows: map[string]int{}, locked: map[string]bool{}}
		m := &rerunOnConflict{&txMutant{Store: s, db: db}}
		return db.harness(storetest.Harness{Backend: m, TTL: time.Hour, Advance: clock.Advance, Now: clock.Now, Faults: m})
	})
}
