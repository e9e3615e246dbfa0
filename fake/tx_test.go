package fake_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// memDB is a table of rows in memory whose transactions buffer their
// writes until commit: the caller's own data, for a TxStore under test.
type memDB struct {
	mu   sync.Mutex
	rows map[string]int
}

type memTx struct {
	db     *memDB
	writes []string
	ended  bool
}

// errRetry makes the retrying begin function of newRetryingTx run the
// transaction again, as a store does after an abort.
var errRetry = errors.New("memdb: aborted, retry")

func (db *memDB) begin(context.Context) (*memTx, error) { return &memTx{db: db}, nil }

func (db *memDB) commit(tx *memTx) error {
	if tx.ended {
		return errors.New("memdb: transaction already ended")
	}
	tx.ended = true
	db.mu.Lock()
	defer db.mu.Unlock()
	if db.rows == nil {
		db.rows = map[string]int{}
	}
	for _, id := range tx.writes {
		db.rows[id]++
	}
	return nil
}

func (db *memDB) rollback(tx *memTx) error {
	tx.ended = true
	return nil
}

// read counts, in tx, the committed rows carrying id and tx's own.
func (db *memDB) read(ctx context.Context, tx *memTx, id string) (int, error) {
	n, _ := db.count(ctx, id)
	for _, w := range tx.writes {
		if w == id {
			n++
		}
	}
	return n, nil
}

// endTx ends tx as a store does on a failed statement: its writes are
// rolled back, and its commit fails.
func endTx(_ context.Context, tx *memTx) error {
	tx.writes, tx.ended = nil, true
	return errors.New("memdb: the statement failed and the transaction was rolled back")
}

func (db *memDB) count(_ context.Context, id string) (int, error) {
	db.mu.Lock()
	defer db.mu.Unlock()
	return db.rows[id], nil
}

func write(_ context.Context, tx *memTx, id string) error {
	tx.writes = append(tx.writes, id)
	return nil
}

// retrying is a TxStore whose transactions run again when the body
// returns errRetry, as client libraries retry an aborted transaction.
type retrying struct {
	*fake.TxStore[*memTx]
}

func (r retrying) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(context.Context, *memTx) error) (bool, error) {
	for {
		ok, err := r.TxStore.CompleteTx(ctx, c, fp, body)
		if !errors.Is(err, errRetry) {
			return ok, err
		}
	}
}

func TestContractTx(t *testing.T) {
	storetest.RunTx(t, func(t *testing.T) storetest.TxHarness[*memTx] {
		clock := fake.NewClock(epoch)
		s := fake.New(fake.WithClock(clock.Now))
		db := &memDB{}
		return storetest.TxHarness[*memTx]{
			Harness: storetest.Harness{
				Backend: retrying{fake.NewTx(s, db.begin, db.commit, db.rollback)},
				TTL:     store.DefaultTTL,
				Advance: clock.Advance,
				Now:     clock.Now,
				Faults:  s,
			},
			Write: write,
			Count: db.count,
			Retry: errRetry,
			Read:  db.read,
			EndTx: endTx,
		}
	})
}

// A failed commit marks nothing, and FailNext fails the call before the
// body runs.
func TestTxStoreCommitFailureMarksNothing(t *testing.T) {
	ctx := t.Context()
	s := fake.New()
	db := &memDB{}
	boom := errors.New("commit refused")
	tx := fake.NewTx(s, db.begin, func(*memTx) error { return boom }, db.rollback)
	r, _ := s.Claim(ctx, "k", store.DefaultLease)
	if ok, err := tx.CompleteTx(ctx, r.Claim, "", func(ctx context.Context, t *memTx) error { return write(ctx, t, "row") }); ok || !errors.Is(err, boom) {
		t.Fatalf("CompleteTx with a failing commit = %v, %v; want false and the commit's error", ok, err)
	}
	if rec, _ := s.Record("k"); rec.State != store.Claimed {
		t.Fatalf("record after a failed commit is %v, want claimed", rec.State)
	}
	injected := errors.New("injected")
	s.FailNext(fake.OpCompleteTx, injected)
	ran := false
	if _, err := tx.CompleteTx(ctx, r.Claim, "", func(context.Context, *memTx) error { ran = true; return nil }); !errors.Is(err, injected) || ran {
		t.Fatalf("CompleteTx after FailNext = %v (body ran: %v); want the injected error and no body", err, ran)
	}
	if n := s.Calls(fake.OpCompleteTx); n != 2 {
		t.Fatalf("Calls(OpCompleteTx) = %d, want 2", n)
	}
}
