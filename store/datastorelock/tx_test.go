package datastorelock_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"cloud.google.com/go/datastore"
	pb "cloud.google.com/go/datastore/apiv1/datastorepb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
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

// The CompleteTx cases of the document-store suite (doclocktest), on the
// Datastore emulator.
func TestDriverTx(t *testing.T) { doclocktest.RunTx[*datastore.Transaction](t, driver{}) }

// Sink is doclocktest's Sink on a sink of the case's own: its shared
// document is an entity of kind Counter.
func (driver) Sink(t testing.TB) doclocktest.Sink[*datastore.Transaction] {
	t.Helper()
	s := newSink(t)
	ent := datastore.NameKey("Counter", "read-by-the-body", nil)
	ent.Namespace = s.ns
	if _, err := s.client.Put(t.Context(), ent, &order{ID: "0"}); err != nil {
		t.Fatal(err)
	}
	return doclocktest.Sink[*datastore.Transaction]{
		Write: s.write,
		Count: s.countErr,
		Read:  s.read,
		RunTx: func(ctx context.Context, body func(tx *datastore.Transaction) error) error {
			_, err := s.client.RunInTransaction(ctx, body)
			return err
		},
		Retry: datastore.ErrConcurrentTransaction,
		EndTx: endTx(s.client, s.ns),
		ReadShared: func(tx *datastore.Transaction) error {
			var o order
			return tx.Get(ent, &o)
		},
		WantUnlocked: func(t *testing.T, reader string) {
			t.Helper()
			ctx := t.Context()
			if _, err := s.client.Put(ctx, ent, &order{ID: "1"}); err != nil {
				t.Fatalf("a plain write to the entity %s read: %v", reader, err)
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
				t.Fatalf("a transaction reading the entity %s read: %v", reader, err)
			}
		},
	}
}

// The conformance suite of store.TxCompleter, with lost replies and cut
// connections.
func TestContractTx(t *testing.T) { doclocktest.RunContractTx[*datastore.Transaction](t, driver{}) }

// Datastore's own (not in doclocktest): it needs a hook at the
// transaction's Lookup of the record, which only this driver's interceptor
// sees as a unary call (Firestore reads in a transaction by a stream).
//
// A renewal of the claim sent between the transaction's read of the
// record (after the body) and its commit does not make the body run again:
// it waits for the commit (and then finds the key Done), where a renewal
// that wrote the record in between would abort the transaction. The test
// gives the renewal up to 200ms to land before the commit goes ahead.
func TestCompleteTxRenewedBeforeItsCommitRunsTheBodyOnce(t *testing.T) {
	s := newSink(t)
	b, r := newBackend(t)
	ctx := t.Context()
	c := doclocktest.Claim(t, b, "k", time.Minute)
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

// Datastore's own (doclocktest's WhoseContextEndsInTheBodyLeavesNoLock
// checks the locks on both): the legacy emulator tells an ended
// transaction from an open one by refusing its Rollback.
//
// A body whose context ends (the caller gave up, or a heartbeat found the
// claim lost) and that returns the context's error leaves no transaction
// open: the rollback does not run on that ended context. (The legacy
// emulator refuses a Rollback of a transaction already ended: "transaction
// has expired or is invalid".)
func TestCompleteTxWhoseContextEndsInTheBodyRollsBack(t *testing.T) {
	s := newSink(t)
	b, r := newBackend(t)
	c := doclocktest.Claim(t, b, "k", time.Minute)
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
