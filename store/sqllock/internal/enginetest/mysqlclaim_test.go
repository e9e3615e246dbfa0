package enginetest

import (
	"context"
	"fmt"
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

// The same call, when the read after its winning insert fails in a way
// that a retry may clear and that says the read itself was refused (here a
// real Error 1205: the read waited out lock_wait_timeout behind a table
// lock), and the key changes hands meanwhile: the retry's insert finds the
// key taken and its read finds the other caller's claim. The call did win
// (fence 1), so it must not answer the other caller's outcome: the insert
// landed, which the retry has to count as a write of this call that may
// have won.
func TestMySQLClaimWhoseInsertWonAndWhoseReadFailedIsNeverAnsweredWithAnotherCallersOutcome(t *testing.T) {
	e := mariadb
	dsn := e.dsn(t)
	c := &counter{}
	// The backend's sessions wait at most a second for a table lock.
	b := e.backend(t, e.open(t, dsn+"?lock_wait_timeout=1", c))
	odb := e.open(t, dsn, nil)
	other, err := sqllock.New(odb, sqllock.MySQL, sqllock.WithTable(tableOf(b)))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	const key = "won-then-read-failed"
	var fired atomic.Bool
	var otherErr error
	unlocked := make(chan struct{})
	hook := func(q string) {
		if !strings.Contains(q, "INSERT IGNORE") || !fired.CompareAndSwap(false, true) {
			return
		}
		defer func() {
			if otherErr != nil {
				close(unlocked)
			}
		}()
		// Our insert landed with a 1ms lease: another caller takes the key
		// once it lapses.
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
			r, err := other.Claim(ctx, key, time.Hour)
			if err != nil {
				otherErr = err
				return
			}
			if r.Outcome == store.Won {
				break
			}
			if time.Now().After(deadline) {
				otherErr = context.DeadlineExceeded
				return
			}
		}
		// An operator's table lock: our read waits a second for it and
		// fails with Error 1205; the lock goes half a second later.
		conn, err := odb.Conn(ctx)
		if err != nil {
			otherErr = err
			return
		}
		if _, err := conn.ExecContext(ctx, "LOCK TABLES `"+tableOf(b)+"` WRITE"); err != nil {
			conn.Close()
			otherErr = err
			return
		}
		go func() {
			defer close(unlocked)
			time.Sleep(1500 * time.Millisecond)
			if _, err := conn.ExecContext(ctx, "UNLOCK TABLES"); err != nil {
				t.Error(err)
			}
			conn.Close()
		}()
	}
	c.afterExec.Store(&hook)
	defer c.afterExec.Store(nil)
	r, err := b.Claim(ctx, key, time.Millisecond)
	if !fired.Load() {
		t.Fatal("the hook never ran")
	}
	<-unlocked
	if otherErr != nil {
		t.Fatalf("the other caller: %v", otherErr)
	}
	t.Logf("claim: %v fence %d, err %v", r.Outcome, r.Claim.Fence, err)
	if err == nil && r.Outcome != store.Won {
		t.Fatalf("Claim whose insert won answered %v (until %v); want won or an error", r.Outcome, r.Until)
	}
	if err == nil && r.Claim.Fence != 1 {
		t.Fatalf("Claim whose insert won answered won with fence %d; want 1", r.Claim.Fence)
	}
}

// A fresh claim on MySQL is one statement, and the lease expiry it reports
// (handed back by LAST_INSERT_ID in the insert's reply) is the one the row
// holds, by the server's clock.
func TestMySQLFreshClaimIsOneStatementAndReportsTheStoredLease(t *testing.T) {
	e := mariadb
	c := &counter{}
	db, b := e.fresh(t, c)
	ctx := t.Context()
	if _, err := b.Claim(ctx, "warm-up", time.Minute); err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		key := fmt.Sprint("fresh-", i)
		c.n.Store(0)
		r, err := b.Claim(ctx, key, time.Duration(i+1)*time.Minute)
		if err != nil || r.Outcome != store.Won || r.Claim.Fence != 1 {
			t.Fatalf("claim: %v fence %d %v", r.Outcome, r.Claim.Fence, err)
		}
		if n := c.n.Load(); n != 1 {
			t.Errorf("a fresh claim took %d statements, want 1", n)
		}
		var lease, exp int64
		if err := db.QueryRowContext(ctx, "SELECT lease_expiry_ms, expires_at_ms FROM "+tableOf(b)+" WHERE idem_key = ?", []byte(key)).Scan(&lease, &exp); err != nil {
			t.Fatal(err)
		}
		if got := r.Claim.LeaseExpiry.UnixMilli(); got != lease {
			t.Fatalf("reported lease expiry %d, the row holds %d", got, lease)
		}
		if exp != lease+b.TTL().Milliseconds() {
			t.Fatalf("expires at %d, want the lease expiry %d + the ttl", exp, lease)
		}
		// The second claim of the key reads the record: the insert id of
		// an ignored insert is never taken for a win.
		c.n.Store(0)
		if r, err := b.Claim(ctx, key, time.Minute); err != nil || r.Outcome != store.HeldByOther || r.Until.UnixMilli() != lease {
			t.Fatalf("second claim: %v until %v %v; want held until %d", r.Outcome, r.Until, err, lease)
		}
	}
}
