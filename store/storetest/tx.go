package storetest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// TxHarness is one [store.TxBackend] under test, with a place in its store
// for the body's own writes.
type TxHarness[Tx any] struct {
	// Harness is as for [Run]; its Backend must implement
	// store.TxBackend[Tx].
	Harness

	// Write adds, in tx, one new row (or entity, or document) of the
	// caller's data carrying id. It never overwrites: two committed
	// writes of the same id must show as two in Count. Required.
	Write func(ctx context.Context, tx Tx, id string) error

	// Count returns how many committed rows carry id, read outside any
	// transaction. Required.
	Count func(ctx context.Context, id string) (int, error)

	// Retry, when set, is an error which, returned by the body, makes the
	// backend run the transaction again with a fresh one (the store's own
	// retry on an abort or a conflict). Nil skips the case about retried
	// transactions, for a store that never retries.
	Retry error

	// Read returns, read in tx, how many rows carry id: the body's own
	// read, which on a store that locks what a transaction reads
	// (Firestore, Spanner, a SELECT ... FOR UPDATE) takes those locks.
	// The case about a panicking body reads with it, and then checks
	// that another transaction can read and write the same rows at once.
	// Nil skips that read (the rest of the case still runs); every
	// backend of this module provides it.
	Read func(ctx context.Context, tx Tx, id string) (int, error)

	// EndTx makes the store itself end tx while the body runs, the way
	// the engine does on its own when a statement fails (SQLite
	// interrupting a statement whose context ended, PostgreSQL aborting
	// the transaction on any failed statement, MariaDB rolling it back
	// on a deadlock, an abort by Spanner, Datastore or Firestore), and
	// returns that statement's error. The cases call it from a body that
	// then swallows the error and returns nil, as a careless body would:
	// whatever the store does next, the Done mark must not commit
	// without the body's writes. A store that retries the transaction
	// after such an end may do so (the case then checks the retry
	// committed once). Nil skips the case about a transaction the store
	// ended; every backend of this module provides it.
	EndTx func(ctx context.Context, tx Tx) error
}

type txRule[Tx any] struct {
	name string
	run  func(t *testing.T, e *txEnv[Tx])
}

type txEnv[Tx any] struct {
	*env
	b     store.TxBackend[Tx]
	write func(ctx context.Context, tx Tx, id string) error
	count func(ctx context.Context, id string) (int, error)
	retry error
	read  func(ctx context.Context, tx Tx, id string) (int, error)
	endTx func(ctx context.Context, tx Tx) error
}

// RunTx runs every case about [store.TxCompleter] as a subtest of t: the
// body's writes and the Done mark commit together or not at all, and never
// for a claim that was replaced. The cases named after features that meet
// (a heartbeat, a panicking body, a store that ends the transaction under
// the body, a claim superseded mid-body) run the backend under
// idempotency.LockTx, and check what it answers and logs as well as what
// committed. newHarness is called once per case, as
// for [Run]. Cases are named "tx_..." and run in parallel with keys and
// row ids of their own.
func RunTx[Tx any](t *testing.T, newHarness func(t *testing.T) TxHarness[Tx]) {
	t.Helper()
	rules := []txRule[Tx]{
		{"tx_commits_the_body_writes_and_the_done_mark_together", txCommit[Tx]},
		{"tx_of_a_completed_claim_commits_nothing_more", txTwice[Tx]},
		{"tx_body_error_leaves_no_writes_and_no_mark", txBodyError[Tx]},
		{"tx_of_a_superseded_holder_commits_nothing", txSuperseded[Tx]},
		{"tx_of_a_released_claim_commits_nothing", txReleased[Tx]},
		{"tx_after_the_lease_lapsed_commits_if_nobody_reclaimed", txAfterLapse[Tx]},
		{"tx_does_not_block_a_concurrent_claim_while_the_body_runs", txConcurrentClaim[Tx]},
		{"tx_retried_by_the_store_commits_the_writes_once", txRetried[Tx]},
		{"tx_with_a_reply_lost_anywhere_commits_both_or_neither", txLostReply[Tx]},
		{"tx_validates_its_arguments_before_any_io", txInvalid[Tx]},
		{"tx_with_a_fingerprint_stores_it_on_the_done_record", txFingerprint[Tx]},
		// Features that meet (txmix.go): these drive idempotency.LockTx.
		{"tx_under_a_heartbeat_runs_the_body_once", txHeartbeatOnce[Tx]},
		{"tx_body_that_panics_leaves_no_lock_and_no_open_transaction", txPanic[Tx]},
		{"tx_ended_by_the_store_during_the_body_gets_no_done_mark", txEnded[Tx]},
		{"tx_superseded_during_the_body_commits_nothing_and_is_in_progress", txSupersededMidBody[Tx]},
		{"tx_that_committed_logs_no_error", txCommittedLogsNoError[Tx]},
	}
	for _, r := range rules {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			b, ok := h.Backend.(store.TxBackend[Tx])
			if !ok {
				t.Fatalf("storetest: %T does not implement store.TxBackend[%T]", h.Backend, *new(Tx))
			}
			if h.Write == nil || h.Count == nil {
				t.Fatal("storetest: TxHarness.Write and TxHarness.Count are required")
			}
			r.run(t, &txEnv[Tx]{env: newEnv(t, h.Harness), b: b, write: h.Write, count: h.Count, retry: h.Retry, read: h.Read, endTx: h.EndTx})
		})
	}
}

// id returns a row id no other case uses.
func (e *txEnv[Tx]) id() string { return e.key() + "/row" }

// completeTx runs CompleteTx with a body that writes id once per call, and
// returns its result and how often the body ran.
func (e *txEnv[Tx]) completeTx(c store.Claim, fp, id string) (bool, int, error) {
	e.t.Helper()
	calls := 0
	ok, err := e.b.CompleteTx(e.ctx, c, fp, func(ctx context.Context, tx Tx) error {
		calls++
		return e.write(ctx, tx, id)
	})
	return ok, calls, err
}

func (e *txEnv[Tx]) rows(id string) int {
	e.t.Helper()
	n, err := e.count(e.ctx, id)
	if err != nil {
		e.t.Fatalf("Count(%q): %v", id, err)
	}
	return n
}

func (e *txEnv[Tx]) wantRows(id string, want int, why string) {
	e.t.Helper()
	if n := e.rows(id); n != want {
		e.t.Fatalf("%s: %d committed rows carry %q, want %d", why, n, id, want)
	}
}

func txCommit[Tx any](t *testing.T, e *txEnv[Tx]) {
	k, id := e.key(), e.id()
	c := e.won(k, e.long())
	ok, calls, err := e.completeTx(c, "", id)
	if err != nil || !ok {
		t.Fatalf("CompleteTx(%q, fence %d) = %v, %v; want true, nil", k, c.Fence, ok, err)
	}
	if calls < 1 {
		t.Fatalf("CompleteTx returned true without calling the body")
	}
	e.wantRows(id, 1, "after a committed CompleteTx")
	e.done[k] = completion{c.Fence, e.h.Now()}
	e.expect(k, store.AlreadyDone)
	// The record is Done with c's fence, as Complete leaves it.
	e.complete(c, true)
}

func txTwice[Tx any](t *testing.T, e *txEnv[Tx]) {
	k, id := e.key(), e.id()
	c := e.won(k, e.long())
	if ok, _, err := e.completeTx(c, "", id); err != nil || !ok {
		t.Fatalf("first CompleteTx = %v, %v; want true, nil", ok, err)
	}
	ok, _, err := e.completeTx(c, "", id)
	if err != nil || ok {
		t.Fatalf("second CompleteTx of the same claim = %v, %v; want false, nil (nothing left to complete)", ok, err)
	}
	e.wantRows(id, 1, "after a second CompleteTx of a completed claim")
	// A plain Complete before it leaves it the same.
	k2, id2 := e.key(), e.id()
	c2 := e.won(k2, e.long())
	e.complete(c2, true)
	if ok, _, err := e.completeTx(c2, "", id2); err != nil || ok {
		t.Fatalf("CompleteTx after Complete = %v, %v; want false, nil", ok, err)
	}
	e.wantRows(id2, 0, "CompleteTx of a claim that Complete already completed")
}

func txBodyError[Tx any](t *testing.T, e *txEnv[Tx]) {
	k, id := e.key(), e.id()
	c := e.won(k, e.long())
	boom := errors.New("storetest: the body failed after its write")
	ok, err := e.b.CompleteTx(e.ctx, c, "", func(ctx context.Context, tx Tx) error {
		if err := e.write(ctx, tx, id); err != nil {
			return err
		}
		return boom
	})
	if ok || !errors.Is(err, boom) {
		t.Fatalf("CompleteTx with a failing body = %v, %v; want false and an error wrapping the body's", ok, err)
	}
	e.wantRows(id, 0, "after a body error")
	// No mark: the key is still held by c, which can release it.
	e.expect(k, store.HeldByOther)
	e.release(c)
	if next := e.won(k, e.long()); next.Fence <= c.Fence {
		t.Fatalf("claim after the release: fence %d, want above %d", next.Fence, c.Fence)
	}
}

func txSuperseded[Tx any](t *testing.T, e *txEnv[Tx]) {
	k, id, id2 := e.key(), e.id(), e.id()
	old := e.won(k, e.short())
	e.pass(e.short())
	next := e.won(k, e.long())
	ok, _, err := e.completeTx(old, "", id)
	if err != nil || ok {
		t.Fatalf("CompleteTx of a superseded holder (fence %d, current %d) = %v, %v; want false, nil", old.Fence, next.Fence, ok, err)
	}
	e.wantRows(id, 0, "a superseded holder's CompleteTx")
	e.expect(k, store.HeldByOther)
	if ok, _, err := e.completeTx(next, "", id2); err != nil || !ok {
		t.Fatalf("the successor's CompleteTx = %v, %v; want true, nil", ok, err)
	}
	e.wantRows(id2, 1, "the successor's CompleteTx")
}

func txReleased[Tx any](t *testing.T, e *txEnv[Tx]) {
	k, id := e.key(), e.id()
	c := e.won(k, e.long())
	e.release(c)
	if ok, _, err := e.completeTx(c, "", id); err != nil || ok {
		t.Fatalf("CompleteTx of a released claim = %v, %v; want false, nil", ok, err)
	}
	e.wantRows(id, 0, "a released claim's CompleteTx")
	if next := e.won(k, e.long()); next.Fence <= c.Fence {
		t.Fatalf("claim after the refused CompleteTx: fence %d, want above %d", next.Fence, c.Fence)
	}
}

func txAfterLapse[Tx any](t *testing.T, e *txEnv[Tx]) {
	k, id := e.key(), e.id()
	c := e.won(k, e.short())
	e.pass(e.short())
	if ok, _, err := e.completeTx(c, "", id); err != nil || !ok {
		t.Fatalf("CompleteTx after the lease lapsed, nobody having reclaimed = %v, %v; want true, nil (the lease is not tested)", ok, err)
	}
	e.wantRows(id, 1, "CompleteTx after the lease lapsed")
	e.done[k] = completion{c.Fence, e.h.Now()}
	e.expect(k, store.AlreadyDone)
}

// txClaimWait bounds how long a Claim may take while another delivery's
// body runs before the case calls it blocked.
const txClaimWait = 30 * time.Second

func txConcurrentClaim[Tx any](t *testing.T, e *txEnv[Tx]) {
	k, id := e.key(), e.id()
	c := e.won(k, e.long())
	type answer struct {
		r   store.Result
		err error
	}
	got := make(chan answer, 1)
	result := make(chan error, 1)
	// One Claim, however often the store runs the body: a second
	// one's answer would fill got while an attempt puts the first back.
	var claimOnce sync.Once
	go func() {
		ok, err := e.b.CompleteTx(e.ctx, c, "", func(ctx context.Context, tx Tx) error {
			if err := e.write(ctx, tx, id); err != nil {
				return err
			}
			// The body is still running: a concurrent delivery of the
			// key must get its answer now, not after the commit.
			claimOnce.Do(func() {
				go func() {
					r, err := e.h.Backend.Claim(e.ctx, k, e.long())
					got <- answer{r, err}
				}()
			})
			select {
			case a := <-got:
				got <- a
				return nil
			case <-time.After(txClaimWait):
				return fmt.Errorf("storetest: a concurrent Claim of %q did not answer within %v while the body ran", k, txClaimWait)
			}
		})
		if err == nil && !ok {
			err = errors.New("CompleteTx returned false for the current claim")
		}
		result <- err
	}()
	if err := <-result; err != nil {
		t.Fatalf("CompleteTx: %v", err)
	}
	a := <-got
	if a.err != nil {
		// An error is a legal answer under contention, but not a verdict.
		t.Logf("the concurrent Claim answered an error: %v", a.err)
	} else if a.r.Outcome != store.HeldByOther {
		t.Fatalf("a Claim while the body ran answered %v, want held by other", a.r.Outcome)
	}
	e.wantRows(id, 1, "CompleteTx with a concurrent Claim")
}

func txRetried[Tx any](t *testing.T, e *txEnv[Tx]) {
	if e.retry == nil {
		t.Skip("TxHarness.Retry is nil: a transaction the store retries is not checked (a store that never retries needs no such case)")
	}
	k, id := e.key(), e.id()
	c := e.won(k, e.long())
	calls := 0
	ok, err := e.b.CompleteTx(e.ctx, c, "", func(ctx context.Context, tx Tx) error {
		calls++
		if err := e.write(ctx, tx, id); err != nil {
			return err
		}
		if calls == 1 {
			return e.retry
		}
		return nil
	})
	if err != nil || !ok {
		t.Fatalf("CompleteTx whose first attempt the store retried = %v, %v (body called %d times); want true, nil", ok, err, calls)
	}
	if calls < 2 {
		t.Fatalf("the body ran %d time(s): Retry did not make the store retry", calls)
	}
	e.wantRows(id, 1, "a retried transaction")
}

// txLostReply loses the next reply at each point of a transaction in turn
// (before the body's write, after it, before the commit) and checks that
// CompleteTx's answer matches what committed: true means the writes exist,
// an error or false that they do not, ErrCommitUnknown that they may; and
// whatever it answered, the writes exist exactly when the key is done.
func txLostReply[Tx any](t *testing.T, e *txEnv[Tx]) {
	f := e.faults()
	for point := range 3 {
		k, id := e.key(), e.id()
		c := e.won(k, e.short())
		ok, err := e.b.CompleteTx(e.ctx, c, "", func(ctx context.Context, tx Tx) error {
			if point == 0 {
				f.LoseNextReply()
			}
			if err := e.write(ctx, tx, id); err != nil {
				return err
			}
			if point >= 1 {
				f.LoseNextReply()
			}
			return nil
		})
		n := e.rows(id)
		switch {
		case err == nil && ok && n != 1:
			t.Fatalf("point %d: CompleteTx = true, but %d rows committed", point, n)
		case err == nil && !ok:
			t.Fatalf("point %d: CompleteTx = false, nil for the only claim of the key", point)
		case err != nil && !errors.Is(err, store.ErrCommitUnknown) && n != 0:
			t.Fatalf("point %d: CompleteTx failed (%v), but %d rows committed", point, err, n)
		case n > 1:
			t.Fatalf("point %d: %d rows committed", point, n)
		}
		// Whatever it answered: once the claim's lease lapses, the key is
		// done exactly when the writes exist.
		e.pass(e.short())
		r := e.claim(k, e.long())
		switch {
		case n == 1 && r.Outcome != store.AlreadyDone:
			t.Fatalf("point %d: the writes committed but the key is %v, not done", point, r.Outcome)
		case n == 0 && r.Outcome != store.Won:
			t.Fatalf("point %d: nothing committed but the key is %v, not free", point, r.Outcome)
		}
	}
}

func txInvalid[Tx any](t *testing.T, e *txEnv[Tx]) {
	called := false
	body := func(context.Context, Tx) error { called = true; return nil }
	c := store.Claim{Key: "", Fence: 1, Token: "x"}
	if _, err := e.b.CompleteTx(e.ctx, c, "", body); !errors.Is(err, store.ErrInvalidKey) {
		t.Fatalf("CompleteTx with an empty key: %v, want ErrInvalidKey", err)
	}
	c = e.won(e.key(), e.long())
	if _, err := e.b.CompleteTx(e.ctx, c, "bad\x00fingerprint", body); !errors.Is(err, store.ErrInvalidFingerprint) {
		t.Fatalf("CompleteTx with an invalid fingerprint: %v, want ErrInvalidFingerprint", err)
	}
	if called {
		t.Fatal("the body ran for invalid arguments")
	}
}

func txFingerprint[Tx any](t *testing.T, e *txEnv[Tx]) {
	if _, ok := e.h.Backend.(store.Fingerprinter); !ok {
		t.Skipf("%T does not implement store.Fingerprinter: the fingerprint CompleteTx stores is not checked", e.h.Backend)
	}
	k, id := e.key(), e.id()
	c := e.won(k, e.long())
	if ok, _, err := e.completeTx(c, "storetest:fp", id); err != nil || !ok {
		t.Fatalf("CompleteTx with a fingerprint = %v, %v", ok, err)
	}
	e.done[k] = completion{c.Fence, e.h.Now()}
	if r := e.expect(k, store.AlreadyDone); r.Fingerprint != "storetest:fp" {
		t.Fatalf("done key reports fingerprint %q, want %q", r.Fingerprint, "storetest:fp")
	}
}
