package enginetest

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// On MySQL a Claim is an INSERT IGNORE and then a read. When the insert
// won the key but its lease lapsed and another caller reclaimed (and
// completed) the key before the read, the call did win: it must not answer
// AlreadyDone or HeldByOther (the delivery would be acked or nacked on
// someone else's outcome while its own claim is unaccounted for). An error
// is the honest answer.
func TestMySQLClaimWhoseInsertWonIsNeverAnsweredWithAnotherCallersOutcome(t *testing.T) {
	e := mariadb
	dsn := e.dsn(t)
	c := &counter{}
	b := e.backend(t, e.open(t, dsn, c))
	other, err := sqllock.New(e.open(t, dsn, nil), sqllock.MySQL, sqllock.WithTable(tableOf(b)))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, then := range []string{"completes", "holds"} {
		t.Run("the other caller "+then, func(t *testing.T) {
			key := "won-then-overtaken/" + then
			var fired atomic.Bool
			var otherErr error
			hook := func(q string) {
				if !strings.Contains(q, "INSERT IGNORE") || !fired.CompareAndSwap(false, true) {
					return
				}
				// The insert has landed with a 1ms lease: let it lapse on
				// the server's clock, then another caller takes the key.
				deadline := time.Now().Add(10 * time.Second)
				for time.Now().Before(deadline) {
					r, err := other.Claim(ctx, key, time.Hour)
					if err != nil {
						otherErr = err
						return
					}
					if r.Outcome == store.Won {
						if then == "completes" {
							_, otherErr = other.Complete(ctx, r.Claim)
						}
						return
					}
					time.Sleep(2 * time.Millisecond)
				}
				otherErr = context.DeadlineExceeded
			}
			c.afterExec.Store(&hook)
			defer c.afterExec.Store(nil)
			r, err := b.Claim(ctx, key, time.Millisecond)
			if otherErr != nil {
				t.Fatalf("the other caller: %v", otherErr)
			}
			if !fired.Load() {
				t.Fatal("the hook never ran")
			}
			if err == nil && r.Outcome != store.Won {
				t.Fatalf("Claim whose insert won answered %v (until %v); want won or an error", r.Outcome, r.Until)
			}
			if err == nil && r.Claim.Fence != 1 {
				t.Fatalf("Claim whose insert won answered won with fence %d; want 1", r.Claim.Fence)
			}
		})
	}
}
