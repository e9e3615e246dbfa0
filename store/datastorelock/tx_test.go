package datastorelock_test

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"cloud.google.com/go/datastore"
	pb "cloud.google.com/go/datastore/apiv1/datastorepb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// The user's data of the CompleteTx tests: one entity of kind "Order" per
// write, a child of the entity group ("OrderGroup", id), so that an
// ancestor query counts them with strong consistency.

// sink is where a test's bodies write, beside the records.
type sink struct {
	client *datastore.Client
	ns     string
}

func newSink(t testing.TB) sink {
	t.Helper()
	testsvc.Datastore(t)
	c, err := datastore.NewClient(context.Background(), project)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return sink{client: c, ns: namespace()}
}

func (s sink) group(id string) *datastore.Key {
	k := datastore.NameKey("OrderGroup", id, nil)
	k.Namespace = s.ns
	return k
}

type order struct{ ID string }

// write adds, in tx, one new Order entity carrying id.
func (s sink) write(tx *datastore.Transaction, id string) error {
	k := datastore.IncompleteKey("Order", s.group(id))
	k.Namespace = s.ns
	_, err := tx.Put(k, &order{ID: id})
	return err
}

// countErr is the number of committed Order entities carrying id.
func (s sink) countErr(ctx context.Context, id string) (int, error) {
	q := datastore.NewQuery("Order").Namespace(s.ns).Ancestor(s.group(id)).KeysOnly()
	keys, err := s.client.GetAll(ctx, q, nil)
	return len(keys), err
}

// read returns, read in tx (an ancestor query), how many Order entities
// carry id.
func (s sink) read(ctx context.Context, tx *datastore.Transaction, id string) (int, error) {
	q := datastore.NewQuery("Order").Namespace(s.ns).Ancestor(s.group(id)).KeysOnly().Transaction(tx)
	keys, err := s.client.GetAll(ctx, q, nil)
	return len(keys), err
}

// endTx makes Datastore itself end tx, as it ends a transaction that lost
// a conflict: tx reads a new entity of its own (kind EndTx, in namespace
// ns), and then a plain write by client changes it. Datastore's
// transactions are optimistic: one whose entity groups changed after it
// read them is aborted at its commit (the legacy emulator answers the
// commit Aborted; a read in tx after the write still sees the snapshot and
// does not fail), and CompleteTx then runs it again, body included. It
// returns the error of its own steps (nil when the conflicting write
// applied).
func endTx(client *datastore.Client, ns string) func(ctx context.Context, tx *datastore.Transaction) error {
	return func(ctx context.Context, tx *datastore.Transaction) error {
		k := datastore.IncompleteKey("EndTx", nil)
		k.Namespace = ns
		k, err := client.Put(ctx, k, &order{ID: "0"})
		if err != nil {
			return err
		}
		var o order
		if err := tx.Get(k, &o); err != nil {
			return err
		}
		_, err = client.Put(ctx, k, &order{ID: "1"})
		return err
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
	storetest.RunTx(t, func(t *testing.T) storetest.TxHarness[*datastore.Transaction] {
		clock := newClock()
		b, f := contractBackend(t, link{}, datastorelock.WithClock(clock.Now))
		s := newSink(t)
		return storetest.TxHarness[*datastore.Transaction]{
			Harness: storetest.Harness{Backend: b, TTL: b.TTL(), Advance: clock.Advance, Now: clock.Now, Faults: f},
			Write:   func(ctx context.Context, tx *datastore.Transaction, id string) error { return s.write(tx, id) },
			Count:   s.countErr,
			Retry:   datastore.ErrConcurrentTransaction,
			Read:    s.read,
			EndTx:   endTx(s.client, s.ns),
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
	ok, err := b.CompleteTx(ctx, c, "fp1", func(ctx context.Context, tx *datastore.Transaction) error {
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
	ok, err = b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *datastore.Transaction) error {
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
	b, _ := newBackend(t, datastorelock.WithClock(clock.Now), datastorelock.WithTTL(time.Hour))
	ctx := t.Context()
	c := claim(t, b, "k", time.Minute)
	clock.Advance(10 * time.Second)
	if ok, err := b.CompleteTx(ctx, c, "", func(context.Context, *datastore.Transaction) error { return nil }); !ok || err != nil {
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
	ok, err := a.CompleteTx(ctx, old, "", func(ctx context.Context, tx *datastore.Transaction) error {
		return s.write(tx, "old")
	})
	if ok || err != nil {
		t.Fatalf("superseded CompleteTx: %v %v, want false, nil", ok, err)
	}
	if n := s.count(t, "old"); n != 0 {
		t.Fatalf("the superseded holder's writes: %d committed, want 0", n)
	}
	ok, err = b.CompleteTx(ctx, cur, "", func(ctx context.Context, tx *datastore.Transaction) error {
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
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *datastore.Transaction) error {
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
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *datastore.Transaction) error {
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

// A commit that never reached the server (the connection dropped as it
// was sent: the process could as well have died between the body's last
// write and the commit) is settled as not committed: an error that is not
// ErrCommitUnknown, no writes, and the claim released, so the key can be
// claimed again at once.
func TestCompleteTxCommitThatNeverLandedIsSettledFalse(t *testing.T) {
	s := newSink(t)
	b, r := newBackend(t)
	ctx := t.Context()
	c := claim(t, b, "k", time.Hour)
	r.dropNextCommit.Store(true)
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *datastore.Transaction) error {
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
	b, r := newBackend(t, datastorelock.WithRetries(0))
	ctx := t.Context()
	c := claim(t, b, "k", time.Hour)
	r.loseNextCommit.Store(true)
	r.whileLost = func() { r.loseNext.Store(true) } // and the settle's first reply
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *datastore.Transaction) error {
		return s.write(tx, "k")
	})
	if ok || !errors.Is(err, store.ErrCommitUnknown) {
		t.Fatalf("CompleteTx: %v %v, want false and ErrCommitUnknown", ok, err)
	}
}

// A ctx that ends after the body's writes and before the commit rolls
// them back: nothing is written and the claim still holds the key.
func TestCompleteTxCancelledBeforeCommitWritesNothing(t *testing.T) {
	s := newSink(t)
	b, _ := newBackend(t)
	c := claim(t, b, "k", time.Hour)
	ctx, cancel := context.WithCancel(t.Context())
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *datastore.Transaction) error {
		defer cancel()
		return s.write(tx, "k")
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

// A transaction that the store aborts (a conflict on an entity the body
// read) is run again with a fresh one, body included: the writes land
// once. So does one whose body reports the abort.
func TestCompleteTxRetriedCommitsOnce(t *testing.T) {
	s := newSink(t)
	b, _ := newBackend(t)
	ctx := t.Context()
	counter := datastore.NameKey("Counter", "c", nil)
	counter.Namespace = s.ns
	if _, err := s.client.Put(ctx, counter, &order{ID: "0"}); err != nil {
		t.Fatal(err)
	}
	t.Run("conflict", func(t *testing.T) {
		c := claim(t, b, "conflict", time.Minute)
		var calls atomic.Int32
		ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *datastore.Transaction) error {
			var o order
			if err := tx.Get(counter, &o); err != nil {
				return err
			}
			if calls.Add(1) == 1 {
				// Another writer changes what this transaction read.
				if _, err := s.client.Put(ctx, counter, &order{ID: "1"}); err != nil {
					return err
				}
			}
			return s.write(tx, "conflict")
		})
		if !ok || err != nil {
			t.Fatalf("CompleteTx: %v %v", ok, err)
		}
		if calls.Load() != 2 {
			t.Fatalf("body called %d times, want 2", calls.Load())
		}
		if n := s.count(t, "conflict"); n != 1 {
			t.Fatalf("%d writes committed, want 1", n)
		}
	})
	t.Run("body", func(t *testing.T) {
		c := claim(t, b, "body", time.Minute)
		var calls atomic.Int32
		ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *datastore.Transaction) error {
			if err := s.write(tx, "body"); err != nil {
				return err
			}
			if calls.Add(1) == 1 {
				return datastore.ErrConcurrentTransaction
			}
			return nil
		})
		if !ok || err != nil || calls.Load() != 2 {
			t.Fatalf("CompleteTx: %v %v after %d calls, want true after 2", ok, err, calls.Load())
		}
		if n := s.count(t, "body"); n != 1 {
			t.Fatalf("%d writes committed, want 1", n)
		}
	})
}

// While a body runs, the transaction holds nothing of the record: a
// concurrent Claim of the key answers HeldByOther before the body ends.
func TestCompleteTxDoesNotBlockAConcurrentClaim(t *testing.T) {
	s := newSink(t)
	a, _, b, _ := twoOnOneClock(t)
	ctx := t.Context()
	c := claim(t, a, "k", time.Minute)
	claimed := make(chan store.Result, 1)
	ok, err := a.CompleteTx(ctx, c, "", func(ctx context.Context, tx *datastore.Transaction) error {
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
	body := func(context.Context, *datastore.Transaction) error { t.Error("body called"); return nil }
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

// A body that panics after reading an entity in its transaction leaves
// nothing of the transaction open: CompleteTx rolls it back (a Rollback
// is sent) and panics again with the body's value. A plain write to the
// entity then succeeds, and a transaction that reads and writes it
// commits; the body's write does not exist, and the claim still holds the
// key.
func TestCompleteTxBodyPanicRollsBackAndLeavesNoLock(t *testing.T) {
	s := newSink(t)
	b, r := newBackend(t)
	ctx := t.Context()
	ent := datastore.NameKey("Counter", "read-by-the-body", nil)
	ent.Namespace = s.ns
	if _, err := s.client.Put(ctx, ent, &order{ID: "0"}); err != nil {
		t.Fatal(err)
	}
	c := claim(t, b, "k", time.Minute)
	r.take()
	boom := errors.New("boom")
	got := func() (v any) {
		defer func() { v = recover() }()
		_, _ = b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *datastore.Transaction) error {
			var o order
			if err := tx.Get(ent, &o); err != nil {
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
	if calls := r.take(); !slices.Contains(calls, "Rollback") || slices.Contains(calls, "Commit") {
		t.Fatalf("RPCs of the panicking CompleteTx: %v, want a Rollback and no Commit", calls)
	}
	if _, err := s.client.Put(ctx, ent, &order{ID: "1"}); err != nil {
		t.Fatalf("a plain write to the entity the panicking body read: %v", err)
	}
	_, err := s.client.RunInTransaction(ctx, func(tx *datastore.Transaction) error {
		var o order
		if err := tx.Get(ent, &o); err != nil {
			return err
		}
		_, err := tx.Put(ent, &order{ID: "2"})
		return err
	}, datastore.MaxAttempts(1))
	if err != nil {
		t.Fatalf("a transaction reading the entity the panicking body read: %v", err)
	}
	if n := s.count(t, "k"); n != 0 {
		t.Fatalf("%d writes of the panicking body committed, want 0", n)
	}
	if res, err := b.Claim(ctx, "k", time.Minute); err != nil || res.Outcome != store.HeldByOther {
		t.Fatalf("claim after the panic: %v %v, want HeldByOther (no mark, the claim still holds)", res.Outcome, err)
	}
}

// A renewal of the claim sent between the transaction's read of the
// record (after the body) and its commit does not make the body run again:
// it waits for the commit (and then finds the key Done), where a renewal
// that wrote the record in between would abort the transaction. The test
// gives the renewal up to 200ms to land before the commit goes ahead.
func TestCompleteTxRenewedBeforeItsCommitRunsTheBodyOnce(t *testing.T) {
	s := newSink(t)
	b, r := newBackend(t)
	ctx := t.Context()
	c := claim(t, b, "k", time.Minute)
	var sent atomic.Bool
	renewed := make(chan error, 1)
	r.afterTxLookup = func() {
		if sent.CompareAndSwap(false, true) {
			go func() {
				_, err := b.Extend(ctx, c, time.Hour)
				renewed <- err
			}()
			select {
			case err := <-renewed:
				renewed <- err
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
	var calls atomic.Int32
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *datastore.Transaction) error {
		calls.Add(1)
		return s.write(tx, "k")
	})
	if !ok || err != nil || calls.Load() != 1 {
		t.Fatalf("CompleteTx: %v %v after %d calls, want true after 1", ok, err, calls.Load())
	}
	if n := s.count(t, "k"); n != 1 {
		t.Fatalf("%d writes committed, want 1", n)
	}
	if err := <-renewed; !errors.Is(err, store.ErrLost) {
		t.Fatalf("the renewal after the commit: %v, want ErrLost (the key is Done)", err)
	}
}

// A body whose context ends (the caller gave up, or a heartbeat found the
// claim lost) and that returns the context's error leaves no transaction
// open: the rollback does not run on that ended context. (The legacy
// emulator refuses a Rollback of a transaction already ended: "transaction
// has expired or is invalid".)
func TestCompleteTxWhoseContextEndsInTheBodyRollsBack(t *testing.T) {
	s := newSink(t)
	b, r := newBackend(t)
	c := claim(t, b, "k", time.Minute)
	ctx, cancel := context.WithCancel(t.Context())
	ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *datastore.Transaction) error {
		if err := s.write(tx, "k"); err != nil {
			return err
		}
		cancel()
		return ctx.Err()
	})
	if ok || !errors.Is(err, context.Canceled) {
		t.Fatalf("CompleteTx: %v %v, want false and the context's error", ok, err)
	}
	id := r.began.Load()
	if id == nil {
		t.Fatal("no transaction began")
	}
	conn := dialEmulator(t, testsvc.Datastore(t))
	_, err = pb.NewDatastoreClient(conn).Rollback(t.Context(), &pb.RollbackRequest{ProjectId: project, Transaction: *id})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("a Rollback of the body's transaction after CompleteTx returned: %v, want InvalidArgument (already ended)", err)
	}
	if n := s.count(t, "k"); n != 0 {
		t.Fatalf("%d writes committed, want 0", n)
	}
}

// The harness's EndTx makes Datastore end the transaction: its commit is
// aborted, and CompleteTx runs it again, body included, which commits the
// writes once.
func TestEndTxMakesDatastoreEndTheTransaction(t *testing.T) {
	s := newSink(t)
	b, _ := newBackend(t)
	end := endTx(s.client, s.ns)
	c := claim(t, b, "k", time.Minute)
	var calls atomic.Int32
	ok, err := b.CompleteTx(t.Context(), c, "", func(ctx context.Context, tx *datastore.Transaction) error {
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
// be, once the first applied) makes CompleteTx run the transaction again,
// body included; that attempt finds the record Done by the first one's
// commit and commits nothing more: CompleteTx returns true, and the
// writes exist once.
func TestCompleteTxCommitThatAppliedButWasAnsweredAbortedIsTrue(t *testing.T) {
	s := newSink(t)
	b, r := newBackend(t)
	c := claim(t, b, "k", time.Minute)
	r.abortNextCommit.Store(true)
	var calls atomic.Int32
	ok, err := b.CompleteTx(t.Context(), c, "", func(ctx context.Context, tx *datastore.Transaction) error {
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
