package fake

import (
	"context"
	"errors"
	"fmt"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// OpCompleteTx names [TxStore.CompleteTx], for fault injection.
const OpCompleteTx Op = OpExtend + 1

// TxStore is a [Store] that also completes claims inside transactions of
// type Tx ([store.TxBackend]), so that a body written for a transactional
// backend (sqllock's *sql.Tx, spannerlock's, datastorelock's or
// firestorelock's transaction) can be unit-tested without the backend's
// server: the transactions come from the test, through the functions
// given to [NewTx] (for example an in-memory SQLite database's *sql.Tx, or
// a type of the test's own), and the records stay in the Store.
//
// CompleteTx begins a transaction, runs the body on it without holding
// the Store (a concurrent Claim answers at once), and then, holding the
// Store, checks that the claim is still current, commits, and marks the
// key done only when the commit succeeded: the body's writes and the mark
// land together, as on a real transactional backend. Build it with
// [NewTx].
type TxStore[Tx any] struct {
	*Store
	begin    func(ctx context.Context) (Tx, error)
	commit   func(tx Tx) error
	rollback func(tx Tx) error
}

var _ store.TxBackend[struct{}] = (*TxStore[struct{}])(nil)

// NewTx returns a TxStore keeping its records in s, with transactions from
// begin, finished by commit or rollback. It panics if any of them is nil.
func NewTx[Tx any](s *Store, begin func(ctx context.Context) (Tx, error), commit, rollback func(tx Tx) error) *TxStore[Tx] {
	if s == nil || begin == nil || commit == nil || rollback == nil {
		panic("fake.NewTx: nil Store, begin, commit or rollback")
	}
	return &TxStore[Tx]{Store: s, begin: begin, commit: commit, rollback: rollback}
}

// CompleteTx implements [store.TxCompleter]: it begins a transaction,
// calls body with it, and commits it together with the Done mark when c is
// still the key's current claim.
//
//   - body's error: the transaction is rolled back, and CompleteTx returns
//     an error wrapping body's.
//   - c is no longer current (replaced, released or completed): rolled
//     back; false, nil.
//   - commit fails: an error wrapping commit's; nothing is marked.
//   - body panics: the transaction is rolled back and the panic goes on.
//
// Faults: [Store.FailNext] with [OpCompleteTx] fails the call before the
// transaction begins. [Store.LoseNextReply] or [Store.CutConnections]
// during the call make it commit and mark the key done, then return an
// error wrapping [store.ErrCommitUnknown] (and [ErrReplyLost]), as a
// backend that lost the commit's reply and could not settle it.
func (t *TxStore[Tx]) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(ctx context.Context, tx Tx) error) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	if err := store.ValidateFingerprint(fp); err != nil {
		return false, err
	}
	if body == nil {
		return false, errors.New("fake: CompleteTx: nil body")
	}
	s := t.Store
	cut := s.cuts.Load()
	s.mu.Lock()
	err := s.begin(ctx, OpCompleteTx, cut)
	s.mu.Unlock()
	if err != nil {
		return false, err
	}
	tx, err := t.begin(ctx)
	if err != nil {
		return false, fmt.Errorf("fake: CompleteTx %q: begin: %w", c.Key, err)
	}
	finished := false
	defer func() {
		if !finished { // the body panicked: roll back, let the panic go on
			t.rollback(tx)
		}
	}()
	err = body(ctx, tx)
	finished = true
	if err != nil {
		return false, errors.Join(fmt.Errorf("fake: CompleteTx %q: the body failed: %w", c.Key, err), t.abort(tx))
	}
	if err := ctx.Err(); err != nil {
		return false, errors.Join(fmt.Errorf("fake: CompleteTx %q: %w", c.Key, err), t.abort(tx))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.recs[c.Key]; !ok || r.State != store.Claimed || r.Fence != c.Fence || r.Token != c.Token {
		return false, t.abort(tx)
	}
	if err := t.commit(tx); err != nil {
		return false, fmt.Errorf("fake: CompleteTx %q: commit: %w", c.Key, err)
	}
	s.complete(c, fp)
	if err := s.reply(OpCompleteTx, cut); err != nil {
		return false, fmt.Errorf("%w: %w", store.ErrCommitUnknown, err)
	}
	return true, nil
}

func (t *TxStore[Tx]) abort(tx Tx) error {
	if err := t.rollback(tx); err != nil {
		return fmt.Errorf("fake: CompleteTx: rollback: %w", err)
	}
	return nil
}
