package storetest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The cases in this file are about features that meet: a transactional
// body (idempotency.LockTx) under a heartbeat, a body that panics, a
// store that ends the transaction under the body, a claim superseded
// while the body runs. Each was proven alone; these cases drive the
// wrapper itself on the backend under test, so that what the wrapper
// answers (ack, 503, nack) and logs is checked together with what the
// store committed. They are the only cases of the suite that import the
// root package: its rules are the wrapper's over the store's.

// mixWait bounds every wait of these cases: a body waiting for renewals,
// for a superseding delivery's answer, or for its cancellation.
const mixWait = 20 * time.Second

// heartbeat is the interval of the cases' heartbeats: the shortest the
// wrapper accepts, for the most renewals per body.
const heartbeat = idempotency.MinHeartbeat

// cancelWait bounds how long a body whose claim was taken waits for its
// heartbeat to cancel it: fifty periods.
const cancelWait = 50 * heartbeat

// errorLog counts the records logged at ERROR or above.
type errorLog struct {
	mu   sync.Mutex
	msgs []string
}

func (l *errorLog) Enabled(_ context.Context, lv slog.Level) bool { return lv >= slog.LevelError }

func (l *errorLog) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	msg := r.Message
	r.Attrs(func(a slog.Attr) bool { msg += " " + a.String(); return true })
	l.msgs = append(l.msgs, msg)
	return nil
}

func (l *errorLog) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *errorLog) WithGroup(string) slog.Handler      { return l }

func (l *errorLog) errors() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.msgs...)
}

// renewals is the backend under test with its renewals counted: the
// cases wait for renewals to run beside a body.
type renewals[Tx any] struct {
	store.TxBackend[Tx]
	ext               store.Extender
	started, finished atomic.Int64
	lost              atomic.Int64 // renewals that found the claim gone
	// lateReply, when set, holds back CompleteTx's answer of a commit
	// until a renewal that started after the commit has returned.
	lateReply bool
}

func (r *renewals[Tx]) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	r.started.Add(1)
	defer r.finished.Add(1)
	next, err := r.ext.Extend(ctx, c, lease)
	if errors.Is(err, store.ErrLost) {
		r.lost.Add(1)
	}
	return next, err
}

// CompleteTx is the backend's; with lateReply, a commit's answer waits
// for a renewal that met the commit, as when the reply is slow: one that
// found the claim gone (the key done by this very commit: the heartbeat
// then renews no more), or one that started after the commit and
// returned (the heartbeat runs one renewal at a time, so the next to
// finish after the one in flight is such a one).
//
// The renewals that found the claim gone are counted from before the call:
// one may land between the commit and CompleteTx's return (sqllock on
// MariaDB makes two more round trips after its COMMIT: a ROLLBACK that
// ends database/sql's transaction, and one that puts the session's idle
// timeout back), and the heartbeat renews no more after it.
func (r *renewals[Tx]) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(context.Context, Tx) error) (bool, error) {
	lost := r.lost.Load()
	ok, err := r.TxBackend.CompleteTx(ctx, c, fp, body)
	if !r.lateReply || !ok || err != nil {
		return ok, err
	}
	after := r.started.Load()
	deadline := time.Now().Add(mixWait)
	for r.finished.Load() <= after && r.lost.Load() == lost {
		if time.Now().After(deadline) {
			return ok, fmt.Errorf("storetest: no renewal ran within %v of the commit", mixWait)
		}
		time.Sleep(heartbeat / 10)
	}
	return ok, err
}

// await waits until n more renewals than before have started (one is in
// flight at a time, so the ones before have returned), or mixWait.
func (r *renewals[Tx]) await(ctx context.Context, before int64, n int64) bool {
	deadline := time.Now().Add(mixWait)
	for r.started.Load() < before+n {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		time.Sleep(heartbeat / 10)
	}
	return true
}

// renewing returns the backend with its renewals counted, or skips the
// case for a backend that cannot renew.
func (e *txEnv[Tx]) renewing() *renewals[Tx] {
	e.t.Helper()
	x, ok := e.b.(store.Extender)
	if !ok {
		e.t.Skipf("%T does not implement store.Extender: a body under a heartbeat is not checked", e.b)
	}
	return &renewals[Tx]{TxBackend: e.b, ext: x}
}

// lockTx runs one delivery of key with idempotency.LockTx on b, logging
// to log, with the lease and, when hb is set, a heartbeat.
func (e *txEnv[Tx]) lockTx(b store.TxBackend[Tx], key string, lease time.Duration, hb bool, log *errorLog, body func(ctx context.Context, tx Tx) error) error {
	opts := []idempotency.LockOption{idempotency.WithLease(lease), idempotency.WithLogger(slog.New(log))}
	if hb {
		opts = append(opts, idempotency.WithHeartbeat(heartbeat))
	}
	return idempotency.LockTx(e.ctx, b, key, body, opts...)
}

// noErrors fails the case if anything was logged at ERROR.
func (e *txEnv[Tx]) noErrors(log *errorLog, what string) {
	e.t.Helper()
	if msgs := log.errors(); len(msgs) > 0 {
		e.t.Fatalf("%s: logged at ERROR: %q", what, msgs)
	}
}

// txHeartbeatOnce: a body under a heartbeat, with nothing else touching
// the key, runs once per delivery. Each renewal writes the claim's record
// (a new lease expiry); a backend that conditions the Done mark on the
// record being unchanged since the claim (a version, an update time)
// finds it changed at every commit and runs the whole transaction, body
// included, again. Renewals go on during the commit.
func txHeartbeatOnce[Tx any](t *testing.T, e *txEnv[Tx]) {
	r := e.renewing()
	log := &errorLog{}
	for round := range 2 {
		k, id := e.key(), e.id()
		var calls atomic.Int32
		err := e.lockTx(r, k, e.long(), true, log, func(ctx context.Context, tx Tx) error {
			calls.Add(1)
			if err := e.write(ctx, tx, id); err != nil {
				return err
			}
			// A renewal beside the body, and in round 0 a period and a
			// half more, for another; in round 1 the body returns as the
			// first renewal starts, so that it runs beside the mark and
			// the commit. (A store that holds a renewal back while the
			// claim's transaction is open, as spannerlock does on the
			// emulator, lets it run after the commit.)
			if !r.await(ctx, r.started.Load(), 1) {
				return fmt.Errorf("storetest: no renewal started within %v of the body", mixWait)
			}
			if round == 0 {
				time.Sleep(3 * heartbeat / 2)
			}
			return nil
		})
		if err != nil {
			t.Fatalf("round %d: LockTx under a heartbeat = %v, want nil", round, err)
		}
		if n := calls.Load(); n != 1 {
			t.Fatalf("round %d: the body ran %d times for one delivery with no other writer; a renewal must not make the store run it again", round, n)
		}
		e.wantRows(id, 1, "a delivery under a heartbeat")
		e.expect(k, store.AlreadyDone)
	}
	e.noErrors(log, "deliveries under a heartbeat that committed")
}

// errPanic is the value the panicking body panics with.
var errPanic = errors.New("storetest: the body panics")

// txPanic: a body that panics after reading and writing leaves nothing
// behind: the panic goes on with its own value, its write does not
// exist, the key is free again at once (the wrapper released it), and
// another delivery's transaction can read and write what the panicking
// body read, at once (no lock or open transaction left holding it).
func txPanic[Tx any](t *testing.T, e *txEnv[Tx]) {
	log := &errorLog{}
	id := e.id()
	if err := e.lockTx(e.b, e.key(), e.long(), false, log, func(ctx context.Context, tx Tx) error {
		return e.write(ctx, tx, id)
	}); err != nil {
		t.Fatalf("the first delivery: %v", err)
	}
	read := func(ctx context.Context, tx Tx) error {
		if e.read == nil {
			return nil
		}
		n, err := e.read(ctx, tx, id)
		if err == nil && n < 1 {
			err = fmt.Errorf("storetest: Read(%q) in a transaction = %d rows, want at least 1", id, n)
		}
		return err
	}
	k := e.key()
	var recovered any
	func() {
		defer func() { recovered = recover() }()
		e.lockTx(e.b, k, e.long(), false, log, func(ctx context.Context, tx Tx) error {
			if err := read(ctx, tx); err != nil {
				return err
			}
			if err := e.write(ctx, tx, id); err != nil {
				return err
			}
			panic(errPanic)
		})
	}()
	if recovered != errPanic {
		t.Fatalf("LockTx with a panicking body: recovered %v, want the body's own panic value", recovered)
	}
	e.wantRows(id, 1, "after a body that panicked after its write")
	// Another delivery of the same key, and one of another key reading
	// and writing the same rows: both commit, promptly.
	ctx, cancel := context.WithTimeout(e.ctx, mixWait)
	defer cancel()
	for _, key := range []string{k, e.key()} {
		start := time.Now()
		err := idempotency.LockTx(ctx, e.b, key, func(ctx context.Context, tx Tx) error {
			if err := read(ctx, tx); err != nil {
				return err
			}
			return e.write(ctx, tx, id)
		}, idempotency.WithLease(e.long()), idempotency.WithLogger(slog.New(log)))
		if err != nil {
			t.Fatalf("a delivery of %q after the panic, reading and writing what the panicking body read: %v after %v (a lock or a transaction left open?)",
				key, err, time.Since(start).Round(time.Millisecond))
		}
	}
	e.wantRows(id, 3, "two deliveries after the panic")
}

// txEnded: a transaction the store itself ends while the body runs (a
// failed statement the body swallows) never gets a Done mark without the
// body's writes. Either the store noticed and ran the transaction again
// (the delivery then succeeds, with the writes once), or nothing
// committed, the delivery is a nack that is not a contention (nobody
// superseded the claim), the key is free at once, and the redelivery
// runs the body and commits.
func txEnded[Tx any](t *testing.T, e *txEnv[Tx]) {
	if e.endTx == nil {
		t.Skip("TxHarness.EndTx is nil: a transaction the store ends under the body is not checked")
	}
	log := &errorLog{}
	k, id := e.key(), e.id()
	var calls atomic.Int32
	err := e.lockTx(e.b, k, e.long(), false, log, func(ctx context.Context, tx Tx) error {
		if err := e.write(ctx, tx, id); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			e.endTx(ctx, tx) // swallowed, as a careless body does
		}
		return nil
	})
	n := e.rows(id)
	if err == nil {
		if n != 1 {
			t.Fatalf("LockTx = nil after the store ended the transaction, but %d rows committed, want 1 (the store's retry)", n)
		}
		e.expect(k, store.AlreadyDone)
		return
	}
	if n != 0 {
		t.Fatalf("LockTx = %v, but %d rows committed", err, n)
	}
	if errors.Is(err, idempotency.ErrInProgress) {
		t.Fatalf("LockTx = %v: a contention, but nobody superseded the claim (the store ended the transaction)", err)
	}
	// The redelivery.
	if err := e.lockTx(e.b, k, e.long(), false, log, func(ctx context.Context, tx Tx) error {
		return e.write(ctx, tx, id)
	}); err != nil {
		t.Fatalf("the redelivery after the store ended the first one's transaction = %v, want it to run the body and commit (a Done mark without the writes?)", err)
	}
	e.wantRows(id, 1, "the redelivery")
}

// superseder is another delivery that takes the key while a body runs,
// from a goroutine of its own, started once however often the store runs
// the body; the body goes on until it answers.
type superseder struct {
	once sync.Once
	done chan struct{} // closed once it answered
	won  bool
	next store.Claim
}

func (s *superseder) start(take func() (store.Claim, bool)) {
	s.once.Do(func() {
		go func() {
			s.next, s.won = take()
			close(s.done)
		}()
	})
}

// txSuperseded: a claim superseded while its body runs commits nothing,
// and the delivery is a contention (ErrInProgress, a 503), never an ack
// nor a 500; the successor's claim stands and can commit. Without a
// heartbeat the claim's lease lapses and another delivery claims the
// key; under a heartbeat, which keeps the lease, an operator releases
// the claim and another delivery claims the key, the next renewal finds
// it gone and cancels the body, which returns its context's error (or,
// on a store that holds renewals back while the transaction is open, the
// body finishes and the mark refuses it). A
// store with one writer (SQLite) makes the other delivery wait for the
// commit instead: the first delivery then commits and the other finds
// the key done, which is right too. A store may run the body again
// (after the other delivery's write aborted its transaction): each
// attempt sees the same other delivery.
func txSupersededMidBody[Tx any](t *testing.T, e *txEnv[Tx]) {
	for _, hb := range []bool{false, true} {
		t.Run(fmt.Sprintf("heartbeat=%v", hb), func(t *testing.T) {
			e := *e
			e.env = &env{t: t, h: e.h, ctx: e.ctx, base: e.base + fmt.Sprint(hb), done: map[string]completion{}}
			supersede(t, &e, hb)
		})
	}
}

func supersede[Tx any](t *testing.T, e *txEnv[Tx], hb bool) {
	log := &errorLog{}
	k, id := e.key(), e.id()
	// A lease that lapses (without a heartbeat), and that LockTx takes.
	lease := max(e.short(), idempotency.MinLease)
	b := e.b
	if hb {
		lease = e.long()
		b = e.renewing()
	}
	s := &superseder{done: make(chan struct{})}
	var cancelled atomic.Bool
	err := e.lockTx(b, k, lease, hb, log, func(ctx context.Context, tx Tx) error {
		if err := e.write(ctx, tx, id); err != nil {
			return err
		}
		c, _ := idempotency.ClaimFrom(ctx)
		s.start(func() (store.Claim, bool) {
			// The case's context, not the body's: a client may keep its
			// transaction in the body's context (Spanner's refuses a
			// nested transaction), and the other delivery is another
			// caller.
			bg, cancel := context.WithTimeout(e.ctx, mixWait)
			defer cancel()
			if hb {
				if err := e.b.Release(bg, c); err != nil { // idemctl release
					return store.Claim{}, false
				}
			} else {
				e.pass(lease)
			}
			r, err := e.b.Claim(bg, k, e.long())
			return r.Claim, err == nil && r.Outcome == store.Won
		})
		select {
		case <-s.done:
			if !s.won || !hb {
				return nil
			}
		case <-time.After(mixWait):
			return nil // the other delivery waits for this one (one writer)
		}
		select {
		case <-ctx.Done():
			cancelled.Store(true)
			return ctx.Err()
		case <-time.After(cancelWait):
			// The body finished first: a store that holds renewals back
			// while the claim's transaction is open (spannerlock on the
			// emulator) finds the loss only at the mark, which must
			// refuse it all the same.
			return nil
		}
	})
	select {
	case <-s.done:
	case <-time.After(2 * mixWait):
		t.Fatalf("LockTx = %v, and the other delivery did not answer within %v (did the body run?)", err, 2*mixWait)
	}
	n := e.rows(id)
	t.Logf("the other delivery took the key while the body ran: %v", s.won)
	if !s.won {
		// The other delivery could not take the key while the body ran.
		if err != nil || n != 1 {
			t.Fatalf("the other delivery did not take the key; LockTx = %v with %d rows, want nil and 1", err, n)
		}
		return
	}
	var ip *idempotency.InProgressError
	if !errors.As(err, &ip) || !ip.Superseded {
		t.Fatalf("LockTx of a claim superseded while its body ran = %v, want an *InProgressError with Superseded (a 503)", err)
	}
	if n != 0 {
		t.Fatalf("a superseded claim's delivery committed %d rows", n)
	}
	if hb {
		t.Logf("the heartbeat cancelled the body: %v", cancelled.Load())
	}
	e.noErrors(log, "a superseded delivery (a contention, not a fault)")
	id2 := e.id()
	if ok, _, err := e.completeTx(s.next, "", id2); err != nil || !ok {
		t.Fatalf("the successor's CompleteTx = %v, %v; want true, nil", ok, err)
	}
	e.wantRows(id2, 1, "the successor")
}

// txCommittedLogsNoError: deliveries that commit, under a heartbeat whose
// renewals land before, during and after the commit, are acked and log
// nothing at ERROR: a renewal that finds the delivery's own Done mark is
// not a lost claim, and a commit that landed is not a failure. The
// commit's answer is held back until a renewal ran after it, so that
// every delivery meets that renewal, whatever the store's speed.
func txCommittedLogsNoError[Tx any](t *testing.T, e *txEnv[Tx]) {
	r := e.renewing()
	r.lateReply = true
	log := &errorLog{}
	for i := range 6 {
		k, id := e.key(), e.id()
		err := e.lockTx(r, k, e.long(), true, log, func(ctx context.Context, tx Tx) error {
			if err := e.write(ctx, tx, id); err != nil {
				return err
			}
			// Bodies that end at different points of the heartbeat's
			// period, so that renewals meet the mark and the commit.
			if !r.await(ctx, r.started.Load(), 1) {
				return fmt.Errorf("storetest: no renewal started within %v of the body", mixWait)
			}
			time.Sleep(time.Duration(i) * heartbeat / 6)
			return nil
		})
		if err != nil {
			t.Fatalf("delivery %d = %v, want nil", i, err)
		}
		e.wantRows(id, 1, "a delivery that committed")
	}
	e.noErrors(log, "deliveries that committed")
}
