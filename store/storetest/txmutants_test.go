package storetest_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// txMutants maps each deliberate bug of a store.TxCompleter to the RunTx
// cases named after the rule it breaks: the suite must fail every one.
var txMutants = map[string][]string{
	"the mark is written before the body runs":         {"tx_body_error_leaves_no_writes_and_no_mark"},
	"the mark is written outside the transaction":      {"tx_with_a_reply_lost_anywhere_commits_both_or_neither"},
	"the fence is not checked":                         {"tx_of_a_superseded_holder_commits_nothing", "tx_of_a_released_claim_commits_nothing"},
	"the writes commit when the claim is fenced out":   {"tx_of_a_superseded_holder_commits_nothing", "tx_of_a_released_claim_commits_nothing"},
	"a completed claim commits again":                  {"tx_of_a_completed_claim_commits_nothing_more"},
	"a body error is answered false, nil":              {"tx_body_error_leaves_no_writes_and_no_mark"},
	"a body error still commits":                       {"tx_body_error_leaves_no_writes_and_no_mark"},
	"the lease is tested":                              {"tx_after_the_lease_lapsed_commits_if_nobody_reclaimed"},
	"the record is locked while the body runs":         {"tx_does_not_block_a_concurrent_claim_while_the_body_runs"},
	"a lost commit reply is answered false":            {"tx_with_a_reply_lost_anywhere_commits_both_or_neither"},
	"a lost commit reply is answered a plain error":    {"tx_with_a_reply_lost_anywhere_commits_both_or_neither"},
	"a retried transaction keeps the earlier writes":   {"tx_retried_by_the_store_commits_the_writes_once"},
	"the store never retries":                          {"tx_retried_by_the_store_commits_the_writes_once"},
	"the writes are dropped but the mark is committed": {"tx_commits_the_body_writes_and_the_done_mark_together"},
	"the fingerprint is dropped":                       {"tx_with_a_fingerprint_stores_it_on_the_done_record"},
	"the key is not validated":                         {"tx_validates_its_arguments_before_any_io"},
	"the fingerprint is not validated":                 {"tx_validates_its_arguments_before_any_io"},
	// Features that meet (txmix.go).
	"a renewal makes the store run the body again": {"tx_under_a_heartbeat_runs_the_body_once"},
	"a renewal during the transaction makes a commit that landed answer unknown": {
		"tx_under_a_heartbeat_runs_the_body_once", "tx_that_committed_logs_no_error"},
	"a panicking body leaves its reads locked":                          {"tx_body_that_panics_leaves_no_lock_and_no_open_transaction"},
	"the mark commits on its own after the store ended the transaction": {"tx_ended_by_the_store_during_the_body_gets_no_done_mark"},
	"a transaction the store ended is answered false, nil":              {"tx_ended_by_the_store_during_the_body_gets_no_done_mark"},
	"a claim superseded mid-body is answered an error, not false":       {"tx_superseded_during_the_body_commits_nothing_and_is_in_progress"},
	"a body cancelled by its context is answered as an unknown commit":  {"tx_superseded_during_the_body_commits_nothing_and_is_in_progress"},
}

// rowDB is the caller's data for the tx mutants: committed rows by id.
type rowDB struct {
	mu     sync.Mutex
	rows   map[string]int
	locked map[string]bool
}

type rowTx struct {
	writes []string
	reads  []string // ids it read, which a mutant may leave locked
	ended  bool     // the store ended it under the body (EndTx)
}

func (db *rowDB) apply(tx *rowTx) {
	db.mu.Lock()
	defer db.mu.Unlock()
	for _, id := range tx.writes {
		db.rows[id]++
	}
}

// read reads id's rows in tx; a row a mutant left locked makes it wait
// for ctx.
func (db *rowDB) read(ctx context.Context, tx *rowTx, id string) (int, error) {
	db.mu.Lock()
	locked := db.locked[id]
	db.mu.Unlock()
	if locked {
		<-ctx.Done()
		return 0, fmt.Errorf("rowdb: %q is locked: %w", id, ctx.Err())
	}
	tx.reads = append(tx.reads, id)
	n, _ := db.count(ctx, id)
	return n, nil
}

// lock leaves tx's reads locked for good.
func (db *rowDB) lock(tx *rowTx) {
	db.mu.Lock()
	defer db.mu.Unlock()
	for _, id := range tx.reads {
		db.locked[id] = true
	}
}

// endTx ends tx as a store does on a failed statement.
func endTx(_ context.Context, tx *rowTx) error {
	tx.writes, tx.ended = nil, true
	return errors.New("rowdb: the statement failed, and the transaction was rolled back")
}

func (db *rowDB) count(_ context.Context, id string) (int, error) {
	db.mu.Lock()
	defer db.mu.Unlock()
	return db.rows[id], nil
}

var errTxRetry = errors.New("rowdb: aborted")

// txMutant is fake.Store with a CompleteTx that follows the rules except
// for one bug.
type txMutant struct {
	*fake.Store
	bug  string
	db   *rowDB
	mu   sync.Mutex  // orders the check, the commit and the mark
	lose atomic.Bool // the next commit's reply is lost
}

func (m *txMutant) is(bug string) bool { return m.bug == bug }

// LoseNextReply loses the reply of the next commit.
func (m *txMutant) LoseNextReply() { m.lose.Store(true) }

func (m *txMutant) CutConnections() { m.Store.CutConnections() }

func (m *txMutant) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(context.Context, *rowTx) error) (bool, error) {
	if !m.is("the key is not validated") {
		if err := store.ValidateKey(c.Key); err != nil {
			return false, err
		}
	}
	if !m.is("the fingerprint is not validated") {
		if err := store.ValidateFingerprint(fp); err != nil {
			return false, err
		}
	}
	if c.Key == "" {
		return false, nil
	}
	if m.is("the mark is written before the body runs") {
		if _, err := m.CompleteFingerprint(ctx, c, fp); err != nil {
			return false, err
		}
	}
	if m.is("the record is locked while the body runs") {
		// A Claim of the key waits for the body as on a row lock.
		m.lockKey(c.Key)
		defer m.unlockKey(c.Key)
	}
	tx := &rowTx{}
	// The record's version as an update-time precondition sees it: each
	// renewal writes the record.
	renewed := m.extends(c.Key)
	for attempt := 0; ; attempt++ {
		began := m.extends(c.Key)
		err := m.run(ctx, body, tx)
		if m.is("a renewal makes the store run the body again") && err == nil && m.extends(c.Key) != began && attempt < 5 {
			tx = &rowTx{}
			continue
		}
		if err != nil && ctx.Err() != nil && m.is("a body cancelled by its context is answered as an unknown commit") {
			return false, fmt.Errorf("mutant: %w", store.ErrCommitUnknown)
		}
		if errors.Is(err, errTxRetry) && !m.is("the store never retries") {
			if !m.is("a retried transaction keeps the earlier writes") {
				tx = &rowTx{}
			}
			continue
		}
		if err != nil {
			if m.is("a body error is answered false, nil") {
				return false, nil
			}
			if m.is("a body error still commits") {
				m.db.apply(tx)
			}
			return false, fmt.Errorf("mutant: the body failed: %w", err)
		}
		break
	}
	if tx.ended {
		switch {
		case m.is("the mark commits on its own after the store ended the transaction"):
			m.CompleteFingerprint(ctx, c, fp)
		case m.is("a transaction the store ended is answered false, nil"):
			return false, nil
		}
		return false, errors.New("mutant: the transaction was ended under the body; nothing committed")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	r, found := m.Record(c.Key)
	current := found && r.Fence == c.Fence && r.Token == c.Token && r.State == store.Claimed
	switch {
	case m.is("the fence is not checked"):
		current = found && r.State == store.Claimed
	case m.is("a completed claim commits again"):
		current = found && r.Fence == c.Fence && r.Token == c.Token
	case m.is("the lease is tested"):
		current = current && time.Now().Before(r.LeaseExpiry) && m.now().Before(r.LeaseExpiry)
	}
	if !current {
		if m.is("the writes commit when the claim is fenced out") {
			m.db.apply(tx)
		}
		if m.is("a claim superseded mid-body is answered an error, not false") {
			return false, errors.New("mutant: the mark matched no record")
		}
		return false, nil
	}
	lost := m.lose.Swap(false)
	if m.is("the mark is written outside the transaction") && lost {
		// The commit of the writes landed; the separate mark did not.
		m.db.apply(tx)
		return false, fmt.Errorf("mutant: %w", store.ErrCommitUnknown)
	}
	if !m.is("the writes are dropped but the mark is committed") {
		m.db.apply(tx)
	}
	if m.is("the fingerprint is dropped") {
		fp = ""
	}
	if !m.is("the mark is written before the body runs") {
		if ok, err := m.CompleteFingerprint(ctx, c, fp); err != nil || !ok {
			return false, fmt.Errorf("mutant: mark: %v %w", ok, err)
		}
	}
	if lost {
		switch {
		case m.is("a lost commit reply is answered false"):
			return false, nil
		case m.is("a lost commit reply is answered a plain error"):
			return false, errors.New("mutant: commit reply lost")
		}
	}
	if m.is("a renewal during the transaction makes a commit that landed answer unknown") && m.extends(c.Key) != renewed {
		return false, fmt.Errorf("mutant: the record changed under the commit: %w", store.ErrCommitUnknown)
	}
	return true, nil
}

// run calls body with tx; for the mutant that leaves a panicking body's
// reads locked, it locks them before the panic goes on.
func (m *txMutant) run(ctx context.Context, body func(context.Context, *rowTx) error, tx *rowTx) error {
	if m.is("a panicking body leaves its reads locked") {
		finished := false
		defer func() {
			if !finished {
				m.db.lock(tx)
			}
		}()
		err := body(ctx, tx)
		finished = true
		return err
	}
	return body(ctx, tx)
}

// renewalCounts counts Extend calls per key, for the mutants that a
// renewal during the transaction trips.
var renewalCounts sync.Map // key -> *atomic.Int64

func (m *txMutant) extends(key string) int64 {
	if n, ok := renewalCounts.Load(key); ok {
		return n.(*atomic.Int64).Load()
	}
	return 0
}

func (m *txMutant) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	n, _ := renewalCounts.LoadOrStore(c.Key, new(atomic.Int64))
	n.(*atomic.Int64).Add(1)
	return m.Store.Extend(ctx, c, lease)
}

// The clock of the fake store, for the mutant that tests the lease.
var txMutantClocks sync.Map // *fake.Store -> *fake.Clock

func (m *txMutant) now() time.Time {
	if c, ok := txMutantClocks.Load(m.Store); ok {
		return c.(*fake.Clock).Now()
	}
	return time.Now()
}

// lockKey and unlockKey make Claim of the key wait, for the mutant that
// locks the record while the body runs.
var txLocked sync.Map // key -> chan struct{}

func (m *txMutant) lockKey(key string) { txLocked.Store(key, make(chan struct{})) }
func (m *txMutant) unlockKey(key string) {
	if ch, ok := txLocked.LoadAndDelete(key); ok {
		close(ch.(chan struct{}))
	}
}

func (m *txMutant) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	if ch, ok := txLocked.Load(key); ok {
		select {
		case <-ch.(chan struct{}):
		case <-ctx.Done():
			return store.Result{}, ctx.Err()
		}
	}
	return m.Store.Claim(ctx, key, lease)
}

// TestTxMutant runs RunTx on the tx mutant that STORETEST_TX_MUTANT
// names. It does nothing unless TestSuiteCatchesTxMutants starts it.
func TestTxMutant(t *testing.T) {
	bug, ok := os.LookupEnv("STORETEST_TX_MUTANT")
	if !ok {
		t.Skip("run by TestSuiteCatchesTxMutants, one process per mutant")
	}
	if _, known := txMutants[bug]; !known && bug != "" {
		t.Fatalf("unknown tx mutant %q", bug)
	}
	storetest.RunTx(t, func(t *testing.T) storetest.TxHarness[*rowTx] {
		clock := fake.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
		s := fake.New(fake.WithClock(clock.Now))
		txMutantClocks.Store(s, clock)
		db := &rowDB{rows: map[string]int{}, locked: map[string]bool{}}
		m := &txMutant{Store: s, bug: bug, db: db}
		return db.harness(storetest.Harness{Backend: m, TTL: time.Hour, Advance: clock.Advance, Now: clock.Now, Faults: m})
	})
}

// harness is the TxHarness of a tx mutant h keeping the caller's rows in
// db.
func (db *rowDB) harness(h storetest.Harness) storetest.TxHarness[*rowTx] {
	return storetest.TxHarness[*rowTx]{
		Harness: h,
		Write: func(_ context.Context, tx *rowTx, id string) error {
			tx.writes = append(tx.writes, id)
			return nil
		},
		Count: db.count,
		Retry: errTxRetry,
		Read:  db.read,
		EndTx: endTx,
	}
}

// TestSuiteCatchesTxMutants runs RunTx on every tx mutant, each in a
// process of its own: every mutant must fail the cases named after the
// rule it breaks, and the mutant with no bug must fail none.
func TestSuiteCatchesTxMutants(t *testing.T) {
	if os.Getenv("STORETEST_TX_MUTANT") != "" {
		t.Skip("inside a mutant run")
	}
	runMutants(t, "TestTxMutant", "STORETEST_TX_MUTANT", txMutants, 16)
}
