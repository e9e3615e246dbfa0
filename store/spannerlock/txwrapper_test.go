package spannerlock_test

import (
	"context"
	"fmt"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"cloud.google.com/go/spanner"

	"github.com/gcp-pubsub-idempotency/idempotency"
)

// LockTx under WithHeartbeat(100ms) with a body of about 350ms and no
// other caller: the body runs once per delivery, and the delivery
// commits.
func TestLockTxUnderAHeartbeatRunsTheBodyOncePerDelivery(t *testing.T) {
	e := newTxEnv(t)
	ctx := t.Context()
	for i := range 3 {
		key, id := "hb/"+string(rune('a'+i)), "hb-row-"+string(rune('a'+i))
		var calls atomic.Int32
		start := time.Now()
		err := idempotency.LockTx(ctx, e.b, key, func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
			calls.Add(1)
			if err := effect(ctx, tx, id); err != nil {
				return err
			}
			select {
			case <-time.After(350 * time.Millisecond):
			case <-ctx.Done():
				return ctx.Err()
			}
			return nil
		}, idempotency.WithLease(2*time.Second), idempotency.WithHeartbeat(100*time.Millisecond))
		t.Logf("delivery %d: %v, body ran %d times, %v", i, err, calls.Load(), time.Since(start).Round(time.Millisecond))
		if err != nil {
			t.Fatalf("delivery %d: LockTx under a heartbeat = %v, want nil", i, err)
		}
		if n := calls.Load(); n != 1 {
			t.Fatalf("delivery %d: the body ran %d times, want once", i, n)
		}
		if n := effects(t, e.look, id); n != 1 {
			t.Fatalf("delivery %d: %d effects, want 1", i, n)
		}
	}
}

// A CompleteTx body that panics after a read and a write leaves no
// transaction open: the client rolls it back (a Rollback RPC) before the
// panic goes on with the body's own value, the write is not committed,
// the next read-write transaction on the database runs without an abort,
// the key stays claimed for the wrapper to release, and no session is
// created. On main no Rollback was sent: the transaction stayed open on
// the server, holding the locks of what the body read and wrote until
// Spanner ends it for idleness (about 10 seconds); the emulator, which
// runs one read-write transaction at a time, drops it for the next one.
func TestCompleteTxBodyThatPanicsLeavesNoTransactionOpen(t *testing.T) {
	e := newTxEnv(t)
	ctx := t.Context()
	e.claim(t, "warm-up", time.Minute) // the client's session
	sessions := func() int {
		e.r.mu.Lock()
		defer e.r.mu.Unlock()
		n := 0
		for _, c := range e.r.calls {
			if c == "CreateSession" || c == "BatchCreateSessions" {
				n++
			}
		}
		return n
	}
	e.r.take()
	created := 0
	take := func() []string {
		created += sessions()
		return e.r.take()
	}
	for i := range 5 {
		key, id := fmt.Sprintf("panic/%d", i), fmt.Sprintf("panic-row-%d", i)
		c := e.claim(t, key, time.Minute)
		take()
		boom := fmt.Errorf("test: the body panics (%d)", i)
		var recovered any
		func() {
			defer func() { recovered = recover() }()
			e.b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
				if _, err := readEffects(ctx, tx, id); err != nil {
					return err
				}
				if err := effect(ctx, tx, id); err != nil {
					return err
				}
				panic(boom)
			})
		}()
		if recovered != boom {
			t.Fatalf("panic %d: recovered %v, want the body's own value", i, recovered)
		}
		want := []string{"ExecuteStreamingSql", "ExecuteSql", "Rollback"}
		if got := take(); !slices.Equal(got, want) {
			t.Fatalf("panic %d: the panicking CompleteTx sent %v, want %v (its read, its write, and the Rollback that ends it)", i, got, want)
		}
		if n := effects(t, e.look, id); n != 0 {
			t.Fatalf("panic %d: %d effects committed", i, n)
		}
		if res, err := e.b.Claim(ctx, key+"/next", time.Minute); err != nil || res.Outcome != store.Won {
			t.Fatalf("panic %d: the next claim: %+v %v", i, res, err)
		}
		if got := take(); !slices.Equal(got, []string{"ExecuteStreamingSql", "Commit"}) {
			t.Fatalf("panic %d: the next call sent %v, want one statement and its Commit (no abort: no transaction left open)", i, got)
		}
		// The key is still c's, unchanged: the wrapper releases it.
		if r := readRecord(t, e.look, key); !r.present || r.state != 1 || r.fence != c.Fence {
			t.Fatalf("panic %d: record %+v, want claimed with fence %d", i, r, c.Fence)
		}
	}
	if created += sessions(); created != 0 {
		t.Fatalf("%d sessions created after the panics", created)
	}
}

// A body that renews its own claim on its own context is not held back
// until its own CompleteTx returns (which waits for the body): the
// Spanner client refuses the renewal's transaction, nested in the
// body's, at once, and the delivery still commits. (A wait would never
// end on a context without a deadline.)
func TestCompleteTxBodyThatRenewsItsOwnClaimIsRefusedNotHeld(t *testing.T) {
	e := newTxEnv(t)
	ctx := t.Context()
	c := e.claim(t, "renews-itself", time.Minute)
	var extErr error
	ok, err := e.b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
		if err := effect(ctx, tx, "renews-itself"); err != nil {
			return err
		}
		_, extErr = e.b.Extend(ctx, c, time.Minute)
		return nil
	})
	if !ok || err != nil {
		t.Fatalf("CompleteTx = %v, %v; want true, nil", ok, err)
	}
	if extErr == nil || !strings.Contains(extErr.Error(), "nested") {
		t.Fatalf("Extend inside the body = %v, want the Spanner client's refusal of a nested transaction", extErr)
	}
	if n := effects(t, e.look, "renews-itself"); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}
