package idempotency_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// settlingTx is a TxStore whose commit fails with an ambiguous error and
// which settles it as datastorelock.settle does: it releases the claim
// (fencing out a commit still in flight), reads the record, finds it not
// Done, and returns a plain error ("did not apply, the claim is
// released"). A lease renewal runs between the release and the answer,
// as it does when the settle's two round trips outlast a heartbeat period.
type settlingTx struct {
	*fake.TxStore[*ledgerTx]
	released chan struct{}
	sawLost  chan struct{}
	once     sync.Once
}

func (s *settlingTx) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	next, err := s.TxStore.Extend(ctx, c, lease)
	if errors.Is(err, store.ErrLost) {
		select {
		case <-s.released:
			s.once.Do(func() { close(s.sawLost) })
		default:
		}
	}
	return next, err
}

func (s *settlingTx) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(context.Context, *ledgerTx) error) (bool, error) {
	if err := body(ctx, &ledgerTx{}); err != nil {
		return false, err
	}
	commitErr := errors.New("commit: rpc error: code = Unavailable") // outcome unknown to the client
	if err := s.Release(context.WithoutCancel(ctx), c); err != nil {
		return false, errors.Join(commitErr, store.ErrCommitUnknown, err)
	}
	close(s.released)
	select {
	case <-s.sawLost:
	case <-time.After(30 * time.Second):
		return false, errors.New("test: no renewal ran during the settle")
	}
	if r, _ := s.Record(c.Key); r.State == store.Done && r.Fence == c.Fence {
		return true, nil
	}
	return false, errors.New("the commit failed and did not apply (the claim is released): " + commitErr.Error())
}

// A transaction that failed to commit is a failure (500, ERROR "did not
// commit"), whatever a renewal saw after the backend released the claim
// to settle that commit (as store.TxCompleter suggests): a renewal that
// finds the claim gone after the body returned does not make it a
// supersession. Found in review of 043743a, which answered a quiet 503
// "superseded" here.
func TestLockTxCommitFailureSettledByAReleaseIsAFailureNotASupersession(t *testing.T) {
	b, _, _ := newTxStore(t)
	s := &settlingTx{TxStore: b, released: make(chan struct{}), sawLost: make(chan struct{})}
	logs, logger := newLogs()
	err := idempotency.LockTx(t.Context(), s, "k", func(ctx context.Context, tx *ledgerTx) error {
		tx.rows = append(tx.rows, "write")
		return nil
	}, idempotency.WithLease(time.Minute), idempotency.WithHeartbeat(idempotency.MinHeartbeat), idempotency.WithLogger(logger))
	if err == nil {
		t.Fatal("LockTx = nil for a commit that failed")
	}
	if errors.Is(err, idempotency.ErrInProgress) {
		t.Errorf("LockTx = %v: a failed commit answered as a superseded claim (503), not a failure", err)
	}
	if len(logs.find(t, "ERROR", "did not commit")) != 1 {
		t.Errorf("no ERROR for a transaction that did not commit; logs: %v", logs.records(t))
	}
}
