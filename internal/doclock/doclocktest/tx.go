package doclocktest

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The body's writes and the Done mark commit together; the record is Done
// with the fingerprint, and a second CompleteTx of the same claim commits
// nothing.
func completeTxCommitsWritesAndMark[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	b, _ := drv.newTx(t, Config{})
	ctx := t.Context()
	c := Claim(t, b, "k", time.Minute)
	ok, err := b.CompleteTx(ctx, c, "fp1", func(ctx context.Context, tx Tx) error {
		return s.Write(tx, "k")
	})
	if !ok || err != nil {
		t.Fatalf("CompleteTx: %v %v", ok, err)
	}
	if n := s.count(t, "k"); n != 1 {
		t.Fatalf("%d writes committed, want 1", n)
	}
	r, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.AlreadyDone || r.Fingerprint != "fp1" {
		t.Fatalf("claim after CompleteTx: %+v %v, want AlreadyDone with fingerprint fp1", r, err)
	}
	ok, err = b.CompleteTx(ctx, c, "", func(ctx context.Context, tx Tx) error {
		return s.Write(tx, "k")
	})
	if ok || err != nil {
		t.Fatalf("second CompleteTx: %v %v, want false, nil", ok, err)
	}
	if n := s.count(t, "k"); n != 1 {
		t.Fatalf("%d writes committed after the second CompleteTx, want 1", n)
	}
}

// The Done record written in the transaction is the one Complete writes:
// a plain Complete of the same claim finds it its own (true), and the
// record expires a ttl after the server's time (here the fake clock's).
func completeTxWritesTheRecordAsCompleteDoes[Tx any](t *testing.T, drv txh[Tx]) {
	drv.sink(t)
	clock := NewClock()
	b, _ := drv.onClockTx(t, clock, Config{TTL: time.Hour})
	ctx := t.Context()
	c := Claim(t, b, "k", time.Minute)
	clock.Advance(10 * time.Second)
	if ok, err := b.CompleteTx(ctx, c, "", func(context.Context, Tx) error { return nil }); !ok || err != nil {
		t.Fatalf("CompleteTx: %v %v", ok, err)
	}
	if ok, err := b.Complete(ctx, c); !ok || err != nil {
		t.Fatalf("Complete after CompleteTx: %v %v, want true (the record is Done by this claim)", ok, err)
	}
	r, err := b.Claim(ctx, "k", time.Minute)
	want := clock.Now().Add(time.Hour)
	if err != nil || r.Outcome != store.AlreadyDone || !r.Until.Equal(want) {
		t.Fatalf("claim: %+v %v, want AlreadyDone until %v", r, err, want)
	}
	if r.Fingerprint != "" {
		t.Fatalf("fingerprint %q, want none", r.Fingerprint)
	}
}

// A holder whose lease lapsed and who was replaced cannot commit: its
// CompleteTx returns false and its writes are absent; the successor's
// commits.
func completeTxOfASupersededHolderCommitsNothing[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	a, _, b, clock := drv.twoOnOneClockTx(t)
	ctx := t.Context()
	old := Claim(t, a, "k", time.Minute)
	clock.Advance(2 * time.Minute)
	cur := Claim(t, b, "k", time.Minute)
	ok, err := a.CompleteTx(ctx, old, "", func(ctx context.Context, tx Tx) error {
		return s.Write(tx, "old")
	})
	if ok || err != nil {
		t.Fatalf("superseded CompleteTx: %v %v, want false, nil", ok, err)
	}
	if n := s.count(t, "old"); n != 0 {
		t.Fatalf("the superseded holder's writes: %d committed, want 0", n)
	}
	ok, err = b.CompleteTx(ctx, cur, "", func(ctx context.Context, tx Tx) error {
		return s.Write(tx, "new")
	})
	if !ok || err != nil {
		t.Fatalf("successor's CompleteTx: %v %v", ok, err)
	}
	if n := s.count(t, "new"); n != 1 {
		t.Fatalf("the successor's writes: %d committed, want 1", n)
	}
}

// A body error rolls back: no writes, no mark, and an error that wraps
// the body's. The claim can then be released and the key claimed again.
func completeTxBodyErrorWritesNothing[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	b, _ := drv.newTx(t, Config{})
	ctx := t.Context()
	c := Claim(t, b, "k", time.Minute)
	boom := errors.New("boom")
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx Tx) error {
		if err := s.Write(tx, "k"); err != nil {
			return err
		}
		return boom
	})
	if ok || !errors.Is(err, boom) {
		t.Fatalf("CompleteTx: %v %v, want false and an error wrapping the body's", ok, err)
	}
	if n := s.count(t, "k"); n != 0 {
		t.Fatalf("%d writes committed, want 0", n)
	}
	if err := b.Release(ctx, c); err != nil {
		t.Fatal(err)
	}
	// The release moved the fence on; the claim takes the next.
	if r := Claim(t, b, "k", time.Minute); r.Fence != c.Fence+2 {
		t.Fatalf("reclaimed at fence %d, want %d", r.Fence, c.Fence+2)
	}
}

// A commit whose reply is lost after it applied is settled: true, the
// writes once, the key Done.
func completeTxLostCommitReplyThatAppliedIsSettledTrue[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	b, r := drv.newTx(t, Config{})
	ctx := t.Context()
	c := Claim(t, b, "k", time.Minute)
	r.LoseNextCommit.Store(true)
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx Tx) error {
		return s.Write(tx, "k")
	})
	if !ok || err != nil {
		t.Fatalf("CompleteTx: %v %v, want true, nil", ok, err)
	}
	if r.Lost.Load() != 1 {
		t.Fatalf("%d replies lost, want 1 (the commit's)", r.Lost.Load())
	}
	if n := s.count(t, "k"); n != 1 {
		t.Fatalf("%d writes committed, want 1", n)
	}
	if res, err := b.Claim(ctx, "k", time.Minute); err != nil || res.Outcome != store.AlreadyDone {
		t.Fatalf("claim: %v %v, want AlreadyDone", res.Outcome, err)
	}
}

// A commit that never reached the server, and whose resends (the
// firestore client resends a commit after Unavailable) end with the
// caller's ctx (as a process that gives up there), is settled as not committed: an error that is not
// ErrCommitUnknown, no writes, and the claim released, so the key can be
// claimed again at once.
func completeTxCommitThatNeverLandedIsSettledFalse[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	b, r := drv.newTx(t, Config{})
	c := Claim(t, b, "k", time.Hour)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	r.DropNextCommit.Store(true)
	r.WhileLost = cancel
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx Tx) error {
		return s.Write(tx, "k")
	})
	if ok || err == nil || errors.Is(err, store.ErrCommitUnknown) {
		t.Fatalf("CompleteTx: %v %v, want false and an error (settled, not unknown)", ok, err)
	}
	if n := s.count(t, "k"); n != 0 {
		t.Fatalf("%d writes committed, want 0", n)
	}
	if res := Claim(t, b, "k", time.Minute); res.Fence != c.Fence+2 {
		t.Fatalf("reclaimed at fence %d, want %d (released, then claimed)", res.Fence, c.Fence+2)
	}
}

// When the settle cannot reach the store either, the error wraps
// ErrCommitUnknown.
func completeTxUnsettledCommitIsUnknown[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	b, r := drv.newTx(t, Config{Retries: Retries(0)})
	ctx := t.Context()
	c := Claim(t, b, "k", time.Hour)
	r.LoseNextCommit.Store(true)
	r.WhileLost = func() { r.LoseNext.Store(true) } // and the settle's first reply
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx Tx) error {
		return s.Write(tx, "k")
	})
	if ok || !errors.Is(err, store.ErrCommitUnknown) {
		t.Fatalf("CompleteTx: %v %v, want false and ErrCommitUnknown", ok, err)
	}
}

// A ctx that ends after the body's writes and before the commit (as a
// process that dies there) rolls them back: nothing is written, an error,
// and the claim still holds the key.
func completeTxCancelledBeforeCommitWritesNothing[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	b, _ := drv.newTx(t, Config{})
	c := Claim(t, b, "k", time.Hour)
	ctx, cancel := context.WithCancel(t.Context())
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx Tx) error {
		defer cancel()
		return s.Write(tx, "k")
	})
	if ok || err == nil {
		t.Fatalf("CompleteTx: %v %v, want false and an error", ok, err)
	}
	if n := s.count(t, "k"); n != 0 {
		t.Fatalf("%d writes committed, want 0", n)
	}
	if res, err := b.Claim(t.Context(), "k", time.Minute); err != nil || res.Outcome != store.HeldByOther {
		t.Fatalf("claim: %v %v, want HeldByOther", res.Outcome, err)
	}
}

// A transaction that the store aborts (here its body reports the store's
// abort, Sink.Retry, as a contended read in it would) is run again with a fresh one, body
// included: the writes land once.
func completeTxRetriedCommitsOnce[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	b, _ := drv.newTx(t, Config{})
	ctx := t.Context()
	c := Claim(t, b, "k", time.Minute)
	var calls atomic.Int32
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx Tx) error {
		if err := s.Write(tx, "k"); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			return s.Retry
		}
		return nil
	})
	if !ok || err != nil || calls.Load() != 2 {
		t.Fatalf("CompleteTx: %v %v after %d calls, want true after 2", ok, err, calls.Load())
	}
	if n := s.count(t, "k"); n != 1 {
		t.Fatalf("%d writes committed, want 1", n)
	}
}

// A claim whose version of the record is stale (it was extended through
// another copy of the claim) still completes, with the body run once: the
// transaction reads the record after the body and keeps the extended
// lease.
func completeTxOnAStaleClaimVersionRunsTheBodyOnce[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	b, _ := drv.newTx(t, Config{})
	ctx := t.Context()
	c := Claim(t, b, "k", time.Minute)
	ext, err := b.Extend(ctx, c, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx Tx) error {
		calls.Add(1)
		return s.Write(tx, "k")
	})
	if !ok || err != nil || calls.Load() != 1 {
		t.Fatalf("CompleteTx: %v %v after %d calls, want true after 1", ok, err, calls.Load())
	}
	if n := s.count(t, "k"); n != 1 {
		t.Fatalf("%d writes committed, want 1", n)
	}
	if ok, err := b.Complete(ctx, ext); !ok || err != nil {
		t.Fatalf("Complete of the extended claim: %v %v, want true (Done by it)", ok, err)
	}
}

// While a body runs, the transaction holds nothing of the record: a
// concurrent Claim of the key answers HeldByOther before the body ends.
func completeTxDoesNotBlockAConcurrentClaim[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	a, _, b, _ := drv.twoOnOneClockTx(t)
	ctx := t.Context()
	c := Claim(t, a, "k", time.Minute)
	claimed := make(chan store.Result, 1)
	ok, err := a.CompleteTx(ctx, c, "", func(ctx context.Context, tx Tx) error {
		if err := s.Write(tx, "k"); err != nil {
			return err
		}
		// The body goes on until the other Claim has answered.
		r, err := b.Claim(ctx, "k", time.Minute)
		if err != nil {
			return err
		}
		claimed <- r
		return nil
	})
	if !ok || err != nil {
		t.Fatalf("CompleteTx: %v %v", ok, err)
	}
	if r := <-claimed; r.Outcome != store.HeldByOther {
		t.Fatalf("concurrent claim: %v, want HeldByOther", r.Outcome)
	}
}

// CompleteTx validates the key and the fingerprint before any I/O.
func completeTxValidatesFirst[Tx any](t *testing.T, drv txh[Tx]) {
	b, r := drv.newTx(t, Config{})
	body := func(context.Context, Tx) error { t.Error("body called"); return nil }
	if _, err := b.CompleteTx(t.Context(), store.Claim{Key: "", Fence: 1, Token: "t"}, "", body); !errors.Is(err, store.ErrInvalidKey) {
		t.Fatalf("empty key: %v", err)
	}
	if _, err := b.CompleteTx(t.Context(), store.Claim{Key: "k", Fence: 1, Token: "t"}, "bad\x00fp", body); !errors.Is(err, store.ErrInvalidFingerprint) {
		t.Fatal("an invalid fingerprint passed")
	}
	if calls := r.Take(); len(calls) != 0 {
		t.Fatalf("RPCs sent: %v", calls)
	}
}

// A body that panics after reading a document in its transaction leaves
// nothing of the transaction open: CompleteTx rolls it back (a Rollback is
// sent, no Commit) and panics again with the body's value. The document is
// then unlocked (Sink.WantUnlocked), the body's write does not exist, and
// the claim still holds the key.
func completeTxBodyPanicRollsBackAndLeavesNoLock[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	b, r := drv.newTx(t, Config{})
	ctx := t.Context()
	c := Claim(t, b, "k", time.Minute)
	r.Take()
	boom := errors.New("boom")
	got := func() (v any) {
		defer func() { v = recover() }()
		_, _ = b.CompleteTx(ctx, c, "", func(ctx context.Context, tx Tx) error {
			if err := s.ReadShared(tx); err != nil {
				return err
			}
			if err := s.Write(tx, "k"); err != nil {
				return err
			}
			panic(boom)
		})
		return nil
	}()
	if got != boom {
		t.Fatalf("CompleteTx recovered %v, want the body's panic value %v", got, boom)
	}
	if calls := r.Take(); !slices.Contains(calls, "Rollback") || slices.Contains(calls, "Commit") {
		t.Fatalf("RPCs of the panicking CompleteTx: %v, want a Rollback and no Commit", calls)
	}
	s.WantUnlocked(t, "the panicking body")
	if n := s.count(t, "k"); n != 0 {
		t.Fatalf("%d writes of the panicking body committed, want 0", n)
	}
	if res, err := b.Claim(ctx, "k", time.Minute); err != nil || res.Outcome != store.HeldByOther {
		t.Fatalf("claim after the panic: %v %v, want HeldByOther (no mark, the claim still holds)", res.Outcome, err)
	}
}

// A body whose context ends (the caller gave up, or a heartbeat found the
// claim lost) and that returns the context's error after reading a
// document leaves it unlocked (Sink.WantUnlocked): the rollback does not run on that ended
// context.
func completeTxWhoseContextEndsInTheBodyLeavesNoLock[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	b, _ := drv.newTx(t, Config{})
	c := Claim(t, b, "k", time.Minute)
	ctx, cancel := context.WithCancel(t.Context())
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx Tx) error {
		if err := s.ReadShared(tx); err != nil {
			return err
		}
		if err := s.Write(tx, "k"); err != nil {
			return err
		}
		cancel()
		return ctx.Err()
	})
	if ok || !errors.Is(err, context.Canceled) {
		t.Fatalf("CompleteTx: %v %v, want false and the context's error", ok, err)
	}
	s.WantUnlocked(t, "the cancelled body")
	if n := s.count(t, "k"); n != 0 {
		t.Fatalf("%d writes committed, want 0", n)
	}
}

// Under WithHeartbeat, with no other writer, the body runs once: the
// renewals of the claim while the body runs (each changes the record's
// update time) do not make the transaction run again.
func lockTxUnderAHeartbeatRunsTheBodyOnce[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	b, _ := drv.newTx(t, Config{})
	var calls atomic.Int32
	err := idempotency.LockTx(t.Context(), b, "k", func(ctx context.Context, tx Tx) error {
		calls.Add(1)
		if err := s.Write(tx, "k"); err != nil {
			return err
		}
		// Long enough for three renewals.
		select {
		case <-time.After(350 * time.Millisecond):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}, idempotency.WithLease(2*time.Second), idempotency.WithHeartbeat(100*time.Millisecond))
	if err != nil {
		t.Fatalf("LockTx: %v", err)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("the body ran %d times, want 1", n)
	}
	if n := s.count(t, "k"); n != 1 {
		t.Fatalf("%d writes committed, want 1", n)
	}
	if r, err := b.Claim(t.Context(), "k", time.Minute); err != nil || r.Outcome != store.AlreadyDone {
		t.Fatalf("claim after LockTx: %v %v, want AlreadyDone", r.Outcome, err)
	}
}

// The sink's EndTx makes the store end the transaction: its commit is
// aborted, and CompleteTx runs it again, body included, which commits the
// writes once.
func endTxMakesTheStoreEndTheTransaction[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	b, _ := drv.newTx(t, Config{})
	end := s.EndTx
	c := Claim(t, b, "k", time.Minute)
	var calls atomic.Int32
	ok, err := b.CompleteTx(t.Context(), c, "", func(ctx context.Context, tx Tx) error {
		if err := s.Write(tx, "k"); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			return end(ctx, tx)
		}
		return nil
	})
	if !ok || err != nil || calls.Load() != 2 {
		t.Fatalf("CompleteTx: %v %v after %d calls, want true after 2 (the first transaction ended by the store)", ok, err, calls.Load())
	}
	if n := s.count(t, "k"); n != 1 {
		t.Fatalf("%d writes committed, want 1", n)
	}
}

// A commit that applied but was answered Aborted (as a resent commit may
// be, once the first applied) makes CompleteTx run the transaction again,
// body included; that attempt finds the record Done by the first one's
// commit and commits nothing more: CompleteTx returns true, and the
// writes exist once.
func completeTxCommitThatAppliedButWasAnsweredAbortedIsTrue[Tx any](t *testing.T, drv txh[Tx]) {
	s := drv.sink(t)
	b, r := drv.newTx(t, Config{})
	c := Claim(t, b, "k", time.Minute)
	r.AbortNextCommit.Store(true)
	var calls atomic.Int32
	ok, err := b.CompleteTx(t.Context(), c, "", func(ctx context.Context, tx Tx) error {
		calls.Add(1)
		return s.Write(tx, "k")
	})
	if !ok || err != nil {
		t.Fatalf("CompleteTx: %v %v after %d calls, want true, nil (the first commit applied)", ok, err, calls.Load())
	}
	if n := s.count(t, "k"); n != 1 {
		t.Fatalf("%d writes committed, want 1", n)
	}
	if ok, err := b.Complete(t.Context(), c); !ok || err != nil {
		t.Fatalf("Complete after CompleteTx: %v %v, want true (Done by this claim)", ok, err)
	}
}

// txCases are the cases of RunTx.
func txCases[Tx any]() []txCase[Tx] {
	return []txCase[Tx]{
		{"CompleteTxCommitsWritesAndMark", completeTxCommitsWritesAndMark[Tx]},
		{"CompleteTxWritesTheRecordAsCompleteDoes", completeTxWritesTheRecordAsCompleteDoes[Tx]},
		{"CompleteTxOfASupersededHolderCommitsNothing", completeTxOfASupersededHolderCommitsNothing[Tx]},
		{"CompleteTxBodyErrorWritesNothing", completeTxBodyErrorWritesNothing[Tx]},
		{"CompleteTxLostCommitReplyThatAppliedIsSettledTrue", completeTxLostCommitReplyThatAppliedIsSettledTrue[Tx]},
		{"CompleteTxCommitThatNeverLandedIsSettledFalse", completeTxCommitThatNeverLandedIsSettledFalse[Tx]},
		{"CompleteTxUnsettledCommitIsUnknown", completeTxUnsettledCommitIsUnknown[Tx]},
		{"CompleteTxCancelledBeforeCommitWritesNothing", completeTxCancelledBeforeCommitWritesNothing[Tx]},
		{"CompleteTxRetriedCommitsOnce", completeTxRetriedCommitsOnce[Tx]},
		{"CompleteTxOnAStaleClaimVersionRunsTheBodyOnce", completeTxOnAStaleClaimVersionRunsTheBodyOnce[Tx]},
		{"CompleteTxDoesNotBlockAConcurrentClaim", completeTxDoesNotBlockAConcurrentClaim[Tx]},
		{"CompleteTxValidatesFirst", completeTxValidatesFirst[Tx]},
		{"CompleteTxBodyPanicRollsBackAndLeavesNoLock", completeTxBodyPanicRollsBackAndLeavesNoLock[Tx]},
		{"CompleteTxWhoseContextEndsInTheBodyLeavesNoLock", completeTxWhoseContextEndsInTheBodyLeavesNoLock[Tx]},
		{"LockTxUnderAHeartbeatRunsTheBodyOnce", lockTxUnderAHeartbeatRunsTheBodyOnce[Tx]},
		{"EndTxMakesTheStoreEndTheTransaction", endTxMakesTheStoreEndTheTransaction[Tx]},
		{"CompleteTxCommitThatAppliedButWasAnsweredAbortedIsTrue", completeTxCommitThatAppliedButWasAnsweredAbortedIsTrue[Tx]},
	}
}

// TxBackend is a Backend that completes claims inside transactions of
// type Tx (store.TxCompleter).
type TxBackend[Tx any] interface {
	Backend
	CompleteTx(ctx context.Context, c store.Claim, fp string, body func(ctx context.Context, tx Tx) error) (bool, error)
}

// Sink is the user's data that the bodies of the CompleteTx cases write,
// beside the records, in a space of the case's own.
type Sink[Tx any] struct {
	// Write adds, in tx, one new write carrying id.
	Write func(tx Tx, id string) error
	// Count returns how many committed writes carry id.
	Count func(ctx context.Context, id string) (int, error)
	// Read returns, read in tx, how many writes carry id (as
	// storetest.TxHarness's Read).
	Read func(ctx context.Context, tx Tx, id string) (int, error)
	// RunTx runs body in a read-write transaction of the sink's client.
	RunTx func(ctx context.Context, body func(tx Tx) error) error
	// Retry is an error a body returns to report the store's abort of its
	// transaction (run it again).
	Retry error
	// EndTx, in a body, makes the store itself end tx (its commit is
	// aborted, and the transaction runs again), as storetest.TxHarness's
	// EndTx does.
	EndTx func(ctx context.Context, tx Tx) error
	// ReadShared reads, in tx, a document (entity) of the sink's own that
	// exists before the case starts.
	ReadShared func(tx Tx) error
	// WantUnlocked fails t unless nothing holds the document that
	// ReadShared reads: a plain write to it succeeds, and so does a
	// transaction that reads and writes it. reader names who read it.
	WantUnlocked func(t *testing.T, reader string)
}

func (s Sink[Tx]) count(t testing.TB, id string) int {
	t.Helper()
	n, err := s.Count(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TxDriver is a Driver whose backends are TxBackends.
type TxDriver[Tx any] interface {
	Driver
	// Sink returns a sink of the case's own on the emulator.
	Sink(t testing.TB) Sink[Tx]
}

// txh is a case's view of a TxDriver.
type txh[Tx any] struct {
	h
	d TxDriver[Tx]
}

func (d txh[Tx]) sink(t testing.TB) Sink[Tx] { return d.d.Sink(t) }

// asTx is b as a TxBackend (a driver whose backends are none panics).
func asTx[Tx any](b Backend, r *Calls) (TxBackend[Tx], *Calls) { return b.(TxBackend[Tx]), r }

func (d txh[Tx]) newTx(t testing.TB, c Config) (TxBackend[Tx], *Calls) {
	t.Helper()
	return asTx[Tx](d.New(t, c))
}

func (d txh[Tx]) onClockTx(t testing.TB, clock *fake.Clock, c Config) (TxBackend[Tx], *Calls) {
	t.Helper()
	return asTx[Tx](d.onClock(t, clock, c))
}

func (d txh[Tx]) twoOnOneClockTx(t testing.TB) (a TxBackend[Tx], ra *Calls, b TxBackend[Tx], clock *fake.Clock) {
	t.Helper()
	x, ra, y, clock := d.twoOnOneClock(t)
	a, _ = asTx[Tx](x, ra)
	b, _ = asTx[Tx](y, nil)
	return a, ra, b, clock
}

type txCase[Tx any] struct {
	name string
	run  func(t *testing.T, d txh[Tx])
}

// RunTx runs every CompleteTx case of the suite on d, each a subtest named
// after the behaviour it checks.
func RunTx[Tx any](t *testing.T, d TxDriver[Tx]) {
	for _, c := range txCases[Tx]() {
		t.Run(c.name, func(t *testing.T) { c.run(t, txh[Tx]{h{d}, d}) })
	}
}
