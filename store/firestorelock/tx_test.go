package firestorelock_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"cloud.google.com/go/firestore"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// The user's data of the CompleteTx tests: one document per write, with a
// generated ID, in a collection of the test's own.

// sink is where a test's bodies write, beside the records.
type sink struct {
	client *firestore.Client
	coll   *firestore.CollectionRef
}

func newSink(t testing.TB) sink {
	t.Helper()
	testsvc.Firestore(t)
	c, err := firestore.NewClient(context.Background(), project)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return sink{client: c, coll: c.Collection("orders_" + collection())}
}

// write adds, in tx, one new document carrying id.
func (s sink) write(tx *firestore.Transaction, id string) error {
	return tx.Create(s.coll.NewDoc(), map[string]any{"id": id})
}

// countErr is the number of committed documents carrying id.
func (s sink) countErr(ctx context.Context, id string) (int, error) {
	docs, err := s.coll.Where("id", "==", id).Documents(ctx).GetAll()
	return len(docs), err
}

// read returns, read in tx (a query, which locks the documents it finds),
// how many documents carry id.
func (s sink) read(tx *firestore.Transaction, id string) (int, error) {
	docs, err := tx.Documents(s.coll.Where("id", "==", id)).GetAll()
	return len(docs), err
}

// endTx makes Firestore itself end tx, as it ends a transaction whose
// commit cannot take its locks: it writes, in tx, a new document of coll
// that another transaction has just read and keeps locked for 5s (its
// read's lock, which it then gives up by rolling back). Firestore buffers
// a transaction's writes until its commit, and no statement of the body
// fails: it is the commit that waits for the lock, and the emulator ends
// the transaction with Aborted ("Transaction lock timeout") after about
// 2s; the client then runs the transaction again, body included. That is
// how the store ends a transaction of its own accord; on the production
// service, whose older transactions win a lock (wound-wait), the commit
// would instead abort the younger reader. It returns the error of its own
// steps (nil when the lock is taken and the write added).
func endTx(client *firestore.Client, coll *firestore.CollectionRef) func(ctx context.Context, tx *firestore.Transaction) error {
	return func(ctx context.Context, tx *firestore.Transaction) error {
		doc := coll.NewDoc()
		if _, err := doc.Create(ctx, map[string]any{"locked": true}); err != nil {
			return err
		}
		locked := make(chan error, 1)
		go func() {
			hold := errors.New("storetest: the lock was held long enough")
			// Not on ctx, which carries tx: the client refuses a
			// transaction nested in another.
			err := client.RunTransaction(context.Background(), func(ctx context.Context, other *firestore.Transaction) error {
				if _, err := other.Get(doc); err != nil {
					return err
				}
				locked <- nil
				time.Sleep(5 * time.Second)
				return hold
			}, firestore.MaxAttempts(1))
			if !errors.Is(err, hold) {
				locked <- err
			}
		}()
		if err := <-locked; err != nil {
			return err
		}
		return tx.Set(doc, map[string]any{"locked": false})
	}
}

func (s sink) count(t testing.TB, id string) int {
	t.Helper()
	n, err := s.countErr(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// The conformance suite of store.TxCompleter, with lost replies and cut
// connections.
func TestContractTx(t *testing.T) {
	storetest.RunTx(t, func(t *testing.T) storetest.TxHarness[*firestore.Transaction] {
		server := newClock()
		b, f := contractBackend(t, link{server: server.Now}, firestorelock.WithClock(server.Now))
		s := newSink(t)
		return storetest.TxHarness[*firestore.Transaction]{
			Harness: storetest.Harness{Backend: b, TTL: b.TTL(), Advance: server.Advance, Now: server.Now, Faults: f},
			Write:   func(ctx context.Context, tx *firestore.Transaction, id string) error { return s.write(tx, id) },
			Count:   s.countErr,
			Retry:   status.Error(codes.Aborted, "contended"),
			Read:    func(ctx context.Context, tx *firestore.Transaction, id string) (int, error) { return s.read(tx, id) },
			EndTx:   endTx(s.client, s.client.Collection("locks_"+collection())),
		}
	})
}

func claim(t testing.TB, b store.Backend, key string, lease time.Duration) store.Claim {
	t.Helper()
	r, err := b.Claim(context.Background(), key, lease)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim %q: %v %v", key, r.Outcome, err)
	}
	return r.Claim
}

// The body's writes and the Done mark commit together; the record is Done
// with the fingerprint, and a second CompleteTx of the same claim commits
// nothing.
func TestCompleteTxCommitsWritesAndMark(t *testing.T) {
	s := newSink(t)
	b, _ := newBackend(t)
	ctx := t.Context()
	c := claim(t, b, "k", time.Minute)
	ok, err := b.CompleteTx(ctx, c, "fp1", func(ctx context.Context, tx *firestore.Transaction) error {
		return s.write(tx, "k")
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
	ok, err = b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *firestore.Transaction) error {
		return s.write(tx, "k")
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
func TestCompleteTxWritesTheRecordAsCompleteDoes(t *testing.T) {
	newSink(t)
	clock := newClock()
	b, _ := onClock(t, clock, firestorelock.WithTTL(time.Hour))
	ctx := t.Context()
	c := claim(t, b, "k", time.Minute)
	clock.Advance(10 * time.Second)
	if ok, err := b.CompleteTx(ctx, c, "", func(context.Context, *firestore.Transaction) error { return nil }); !ok || err != nil {
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
func TestCompleteTxOfASupersededHolderCommitsNothing(t *testing.T) {
	s := newSink(t)
	a, _, b, clock := twoOnOneClock(t)
	ctx := t.Context()
	old := claim(t, a, "k", time.Minute)
	clock.Advance(2 * time.Minute)
	cur := claim(t, b, "k", time.Minute)
	ok, err := a.CompleteTx(ctx, old, "", func(ctx context.Context, tx *firestore.Transaction) error {
		return s.write(tx, "old")
	})
	if ok || err != nil {
		t.Fatalf("superseded CompleteTx: %v %v, want false, nil", ok, err)
	}
	if n := s.count(t, "old"); n != 0 {
		t.Fatalf("the superseded holder's writes: %d committed, want 0", n)
	}
	ok, err = b.CompleteTx(ctx, cur, "", func(ctx context.Context, tx *firestore.Transaction) error {
		return s.write(tx, "new")
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
func TestCompleteTxBodyErrorWritesNothing(t *testing.T) {
	s := newSink(t)
	b, _ := newBackend(t)
	ctx := t.Context()
	c := claim(t, b, "k", time.Minute)
	boom := errors.New("boom")
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *firestore.Transaction) error {
		if err := s.write(tx, "k"); err != nil {
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
	if r := claim(t, b, "k", time.Minute); r.Fence != c.Fence+2 {
		t.Fatalf("reclaimed at fence %d, want %d", r.Fence, c.Fence+2)
	}
}

// A commit whose reply is lost after it applied is settled: true, the
// writes once, the key Done.
func TestCompleteTxLostCommitReplyThatAppliedIsSettledTrue(t *testing.T) {
	s := newSink(t)
	b, r := newBackend(t)
	ctx := t.Context()
	c := claim(t, b, "k", time.Minute)
	r.loseNextCommit.Store(true)
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *firestore.Transaction) error {
		return s.write(tx, "k")
	})
	if !ok || err != nil {
		t.Fatalf("CompleteTx: %v %v, want true, nil", ok, err)
	}
	if r.lost.Load() != 1 {
		t.Fatalf("%d replies lost, want 1 (the commit's)", r.lost.Load())
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
// caller's ctx, is settled as not committed: an error that is not
// ErrCommitUnknown, no writes, and the claim released, so the key can be
// claimed again at once.
func TestCompleteTxCommitThatNeverLandedIsSettledFalse(t *testing.T) {
	s := newSink(t)
	b, r := newBackend(t)
	c := claim(t, b, "k", time.Hour)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	r.dropNextCommit.Store(true)
	r.whileLost = cancel
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *firestore.Transaction) error {
		return s.write(tx, "k")
	})
	if ok || err == nil || errors.Is(err, store.ErrCommitUnknown) {
		t.Fatalf("CompleteTx: %v %v, want false and an error (settled, not unknown)", ok, err)
	}
	if n := s.count(t, "k"); n != 0 {
		t.Fatalf("%d writes committed, want 0", n)
	}
	if res := claim(t, b, "k", time.Minute); res.Fence != c.Fence+2 {
		t.Fatalf("reclaimed at fence %d, want %d (released, then claimed)", res.Fence, c.Fence+2)
	}
}

// When the settle cannot reach the store either, the error wraps
// ErrCommitUnknown.
func TestCompleteTxUnsettledCommitIsUnknown(t *testing.T) {
	s := newSink(t)
	b, r := newBackend(t, firestorelock.WithRetries(0))
	ctx := t.Context()
	c := claim(t, b, "k", time.Hour)
	r.loseNextCommit.Store(true)
	r.whileLost = func() { r.loseNext.Store(true) } // and the settle's first reply
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *firestore.Transaction) error {
		return s.write(tx, "k")
	})
	if ok || !errors.Is(err, store.ErrCommitUnknown) {
		t.Fatalf("CompleteTx: %v %v, want false and ErrCommitUnknown", ok, err)
	}
}

// A ctx that ends after the body's writes and before the commit (as a
// process that dies there) leaves nothing written, and an error.
func TestCompleteTxCancelledBeforeCommitWritesNothing(t *testing.T) {
	s := newSink(t)
	b, _ := newBackend(t)
	c := claim(t, b, "k", time.Hour)
	ctx, cancel := context.WithCancel(t.Context())
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *firestore.Transaction) error {
		defer cancel()
		return s.write(tx, "k")
	})
	if ok || err == nil {
		t.Fatalf("CompleteTx: %v %v, want false and an error", ok, err)
	}
	if n := s.count(t, "k"); n != 0 {
		t.Fatalf("%d writes committed, want 0", n)
	}
	if res, err := b.Claim(t.Context(), "k", time.Minute); err != nil || res.Outcome == store.AlreadyDone {
		t.Fatalf("claim: %v %v, want the key not Done", res.Outcome, err)
	}
}

// A transaction that Firestore aborts (here its body reports Aborted, as
// a contended read in it would) is run again with a fresh one, body
// included: the writes land once.
func TestCompleteTxRetriedCommitsOnce(t *testing.T) {
	s := newSink(t)
	b, _ := newBackend(t)
	ctx := t.Context()
	c := claim(t, b, "k", time.Minute)
	var calls atomic.Int32
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *firestore.Transaction) error {
		if err := s.write(tx, "k"); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			return status.Error(codes.Aborted, "contended")
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
func TestCompleteTxOnAStaleClaimVersionRunsTheBodyOnce(t *testing.T) {
	s := newSink(t)
	b, _ := newBackend(t)
	ctx := t.Context()
	c := claim(t, b, "k", time.Minute)
	ext, err := b.Extend(ctx, c, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *firestore.Transaction) error {
		calls.Add(1)
		return s.write(tx, "k")
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
func TestCompleteTxDoesNotBlockAConcurrentClaim(t *testing.T) {
	s := newSink(t)
	a, _, b, _ := twoOnOneClock(t)
	ctx := t.Context()
	c := claim(t, a, "k", time.Minute)
	claimed := make(chan store.Result, 1)
	ok, err := a.CompleteTx(ctx, c, "", func(ctx context.Context, tx *firestore.Transaction) error {
		if err := s.write(tx, "k"); err != nil {
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
func TestCompleteTxValidatesFirst(t *testing.T) {
	b, r := newBackend(t)
	body := func(context.Context, *firestore.Transaction) error { t.Error("body called"); return nil }
	if _, err := b.CompleteTx(t.Context(), store.Claim{Key: "", Fence: 1, Token: "t"}, "", body); !errors.Is(err, store.ErrInvalidKey) {
		t.Fatalf("empty key: %v", err)
	}
	if _, err := b.CompleteTx(t.Context(), store.Claim{Key: "k", Fence: 1, Token: "t"}, "bad\x00fp", body); !errors.Is(err, store.ErrInvalidFingerprint) {
		t.Fatal("an invalid fingerprint passed")
	}
	if calls := r.take(); len(calls) != 0 {
		t.Fatalf("RPCs sent: %v", calls)
	}
}

// A body that panics after reading a document in its transaction leaves
// nothing of the transaction open: CompleteTx rolls it back and panics
// again with the body's value. A plain write to the document then succeeds
// (the emulator holds a write to a document that an open transaction read
// for its lock timeout, then answers Aborted), and a transaction that
// reads and writes it commits; the body's write does not exist, and the
// claim still holds the key.
func TestCompleteTxBodyPanicRollsBackAndLeavesNoLock(t *testing.T) {
	s := newSink(t)
	b, _ := newBackend(t)
	ctx := t.Context()
	doc := s.coll.Doc("read-by-the-body")
	if _, err := doc.Set(ctx, map[string]any{"id": "read"}); err != nil {
		t.Fatal(err)
	}
	c := claim(t, b, "k", time.Minute)
	boom := errors.New("boom")
	got := func() (v any) {
		defer func() { v = recover() }()
		_, _ = b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *firestore.Transaction) error {
			if _, err := tx.Get(doc); err != nil {
				return err
			}
			if err := s.write(tx, "k"); err != nil {
				return err
			}
			panic(boom)
		})
		return nil
	}()
	if got != boom {
		t.Fatalf("CompleteTx recovered %v, want the body's panic value %v", got, boom)
	}
	s.wantUnlocked(t, doc, "the panicking body")
	if n := s.count(t, "k"); n != 0 {
		t.Fatalf("%d writes of the panicking body committed, want 0", n)
	}
	if r, err := b.Claim(ctx, "k", time.Minute); err != nil || r.Outcome != store.HeldByOther {
		t.Fatalf("claim after the panic: %v %v, want HeldByOther (no mark, the claim still holds)", r.Outcome, err)
	}
}

// wantUnlocked fails t unless nothing holds doc locked: a plain write to
// it succeeds (the emulator holds a write to a document that an open
// transaction read for its lock timeout, then answers Aborted), and so
// does a transaction that reads and writes it.
func (s sink) wantUnlocked(t *testing.T, doc *firestore.DocumentRef, reader string) {
	t.Helper()
	ctx := t.Context()
	if _, err := doc.Set(ctx, map[string]any{"id": "read", "n": 1}); err != nil {
		t.Fatalf("a plain write to the document %s read: %v", reader, err)
	}
	err := s.client.RunTransaction(ctx, func(ctx context.Context, tx *firestore.Transaction) error {
		if _, err := tx.Get(doc); err != nil {
			return err
		}
		return tx.Set(doc, map[string]any{"id": "read", "n": 2})
	}, firestore.MaxAttempts(1))
	if err != nil {
		t.Fatalf("a transaction reading the document %s read: %v", reader, err)
	}
}

// A body whose context ends (the caller gave up, or a heartbeat found the
// claim lost) and that returns the context's error after reading a
// document leaves it unlocked: the rollback does not run on that ended
// context.
func TestCompleteTxWhoseContextEndsInTheBodyLeavesNoLock(t *testing.T) {
	s := newSink(t)
	b, _ := newBackend(t)
	doc := s.coll.Doc("read-by-the-body")
	if _, err := doc.Set(t.Context(), map[string]any{"id": "read"}); err != nil {
		t.Fatal(err)
	}
	c := claim(t, b, "k", time.Minute)
	ctx, cancel := context.WithCancel(t.Context())
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *firestore.Transaction) error {
		if _, err := tx.Get(doc); err != nil {
			return err
		}
		if err := s.write(tx, "k"); err != nil {
			return err
		}
		cancel()
		return ctx.Err()
	})
	if ok || !errors.Is(err, context.Canceled) {
		t.Fatalf("CompleteTx: %v %v, want false and the context's error", ok, err)
	}
	s.wantUnlocked(t, doc, "the cancelled body")
	if n := s.count(t, "k"); n != 0 {
		t.Fatalf("%d writes committed, want 0", n)
	}
}

// Under WithHeartbeat, with no other writer, the body runs once: the
// renewals of the claim while the body runs (each changes the record's
// update time) do not make the transaction run again.
func TestLockTxUnderAHeartbeatRunsTheBodyOnce(t *testing.T) {
	s := newSink(t)
	b, _ := newBackend(t)
	var calls atomic.Int32
	err := idempotency.LockTx(t.Context(), b, "k", func(ctx context.Context, tx *firestore.Transaction) error {
		calls.Add(1)
		if err := s.write(tx, "k"); err != nil {
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

// The harness's EndTx makes Firestore end the transaction: its commit is
// aborted, and the client runs it again, body included, which commits the
// writes once.
func TestEndTxMakesFirestoreEndTheTransaction(t *testing.T) {
	s := newSink(t)
	b, _ := newBackend(t)
	end := endTx(s.client, s.client.Collection("locks_"+collection()))
	c := claim(t, b, "k", time.Minute)
	var calls atomic.Int32
	ok, err := b.CompleteTx(t.Context(), c, "", func(ctx context.Context, tx *firestore.Transaction) error {
		if err := s.write(tx, "k"); err != nil {
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
// be, once the first applied) makes the client run the transaction again,
// body included; that attempt finds the record Done by the first one's
// commit and commits nothing more: CompleteTx returns true, and the
// writes exist once.
func TestCompleteTxCommitThatAppliedButWasAnsweredAbortedIsTrue(t *testing.T) {
	s := newSink(t)
	b, r := newBackend(t)
	c := claim(t, b, "k", time.Minute)
	r.abortNextCommit.Store(true)
	var calls atomic.Int32
	ok, err := b.CompleteTx(t.Context(), c, "", func(ctx context.Context, tx *firestore.Transaction) error {
		calls.Add(1)
		return s.write(tx, "k")
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
