package storetest_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// slowCommitReply is the tx mutant with no bug, whose commit's reply is
// slower than the heartbeat: once a commit landed, CompleteTx answers only
// after a renewal of the key found it done (store.ErrLost), which ends the
// heartbeat's renewals, or after a second. sqllock's CompleteTx on
// MariaDB can on a loaded machine: after its COMMIT it makes two more
// round trips (a ROLLBACK that ends database/sql's transaction, and one
// that puts the session's idle_write_transaction_timeout back), in which
// a renewal every 100 ms may land.
type slowCommitReply struct {
	*txMutant
	mu       sync.Mutex
	renewing map[string]bool          // keys a heartbeat renews
	lost     map[string]chan struct{} // closed once a renewal of the key found it done
}

func (s *slowCommitReply) lostCh(key string) chan struct{} {
	if s.lost[key] == nil {
		s.lost[key] = make(chan struct{})
	}
	return s.lost[key]
}

func (s *slowCommitReply) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	s.mu.Lock()
	s.renewing[c.Key] = true
	s.mu.Unlock()
	next, err := s.txMutant.Extend(ctx, c, lease)
	if errors.Is(err, store.ErrLost) {
		s.mu.Lock()
		if ch := s.lostCh(c.Key); !isClosed(ch) {
			close(ch)
		}
		s.mu.Unlock()
	}
	return next, err
}

func isClosed(ch chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func (s *slowCommitReply) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(context.Context, *rowTx) error) (bool, error) {
	s.mu.Lock()
	s.lost[c.Key] = nil // a renewal of an earlier life of the key does not count
	s.mu.Unlock()
	ok, err := s.txMutant.CompleteTx(ctx, c, fp, body)
	s.mu.Lock()
	renewing, ch := s.renewing[c.Key], s.lostCh(c.Key)
	s.mu.Unlock()
	if ok && err == nil && renewing {
		select {
		case <-ch:
		case <-time.After(time.Second):
		}
	}
	return ok, err
}

// RunTx passes a correct backend whose commit's reply comes after the
// heartbeat's next renewal, which finds the key done by the commit and
// ends the renewals. tx_that_committed_logs_no_error, which holds the
// commit's answer back until a renewal met the commit, counted only the
// renewals that met it after CompleteTx returned, and failed MariaDB's
// TestTxContract under load ("no renewal ran within 20s of the commit",
// 3 runs in 12 of TestTxContract and TestOps beside a TestContract).
func TestRunTxWithACommitReplySlowerThanTheHeartbeat(t *testing.T) {
	storetest.RunTx(t, func(t *testing.T) storetest.TxHarness[*rowTx] {
		s := fake.New(fake.WithTTL(time.Second))
		db := &rowDB{rows: map[string]int{}, locked: map[string]bool{}}
		m := &slowCommitReply{txMutant: &txMutant{Store: s, db: db}, renewing: map[string]bool{}, lost: map[string]chan struct{}{}}
		return db.harness(storetest.Harness{Backend: m, TTL: time.Second, Step: 50 * time.Millisecond, Faults: m})
	})
}
