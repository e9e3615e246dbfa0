package firestorelock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"cloud.google.com/go/firestore"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
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

// The CompleteTx cases of the document-store suite (doclocktest), on the
// Firestore emulator.
func TestDriverTx(t *testing.T) { doclocktest.RunTx[*firestore.Transaction](t, driver{}) }

// Sink is doclocktest's Sink on a sink of the case's own: its shared
// document is one of the sink's collection.
func (driver) Sink(t testing.TB) doclocktest.Sink[*firestore.Transaction] {
	t.Helper()
	s := newSink(t)
	doc := s.coll.Doc("read-by-the-body")
	if _, err := doc.Set(t.Context(), map[string]any{"id": "read"}); err != nil {
		t.Fatal(err)
	}
	return doclocktest.Sink[*firestore.Transaction]{
		Write: s.write,
		Count: s.countErr,
		Read:  func(ctx context.Context, tx *firestore.Transaction, id string) (int, error) { return s.read(tx, id) },
		RunTx: func(ctx context.Context, body func(tx *firestore.Transaction) error) error {
			return s.client.RunTransaction(ctx, func(_ context.Context, tx *firestore.Transaction) error { return body(tx) })
		},
		Retry: status.Error(codes.Aborted, "contended"),
		EndTx: endTx(s.client, s.client.Collection("locks_"+collection())),
		ReadShared: func(tx *firestore.Transaction) error {
			_, err := tx.Get(doc)
			return err
		},
		// A plain write to the document (the emulator holds a write to a
		// document that an open transaction read for its lock timeout,
		// then answers Aborted), and a transaction that reads and writes
		// it.
		WantUnlocked: func(t *testing.T, reader string) {
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
		},
	}
}

// The conformance suite of store.TxCompleter, with lost replies and cut
// connections.
func TestContractTx(t *testing.T) { doclocktest.RunContractTx[*firestore.Transaction](t, driver{}) }
