package idempotency_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// ledger is the caller's own data for the transactional tests: committed
// rows, and transactions that buffer their rows until commit.
type ledger struct {
	mu        sync.Mutex
	rows      []string
	commitErr error // the next commit fails with it
}

type ledgerTx struct {
	l    *ledger
	rows []string
}

func (l *ledger) begin(context.Context) (*ledgerTx, error) { return &ledgerTx{l: l}, nil }

func (l *ledger) commit(tx *ledgerTx) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.commitErr; err != nil {
		l.commitErr = nil
		return err
	}
	l.rows = append(l.rows, tx.rows...)
	return nil
}

func (l *ledger) rollback(*ledgerTx) error { return nil }

func (l *ledger) committed() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.rows...)
}

func newTxStore(t *testing.T) (*fake.TxStore[*ledgerTx], *ledger, *fake.Clock) {
	s, clock := newStore(t)
	l := &ledger{}
	return fake.NewTx(s, l.begin, l.commit, l.rollback), l, clock
}

func TestLockTxCommitsTheWritesAndTheMarkTogether(t *testing.T) {
	ctx := t.Context()
	b, l, _ := newTxStore(t)
	body := func(ctx context.Context, tx *ledgerTx) error {
		if c, ok := idempotency.ClaimFrom(ctx); !ok || c.Key != "order-1" {
			t.Errorf("the body's context carries claim %+v, %v", c, ok)
		}
		tx.rows = append(tx.rows, "charge order-1")
		return nil
	}
	if err := idempotency.LockTx(ctx, b, "order-1", body); err != nil {
		t.Fatal(err)
	}
	if rec, _ := b.Record("order-1"); rec.State != store.Done {
		t.Fatalf("record %+v, want done", rec)
	}
	if err := idempotency.LockTx(ctx, b, "order-1", body); !idempotency.IsOwnDuplicate(err, "order-1") {
		t.Fatalf("second delivery: %v, want its own duplicate", err)
	}
	if got := l.committed(); len(got) != 1 {
		t.Fatalf("committed rows %q, want one", got)
	}
}

func TestLockTxBodyErrorRollsBackAndReleases(t *testing.T) {
	ctx := t.Context()
	b, l, _ := newTxStore(t)
	boom := errors.New("supplier refused")
	err := idempotency.LockTx(ctx, b, "k", func(ctx context.Context, tx *ledgerTx) error {
		tx.rows = append(tx.rows, "half-done")
		return boom
	})
	if err != boom {
		t.Fatalf("LockTx = %v, want the body's error unchanged", err)
	}
	if got := l.committed(); len(got) != 0 {
		t.Fatalf("committed rows %q after a body error", got)
	}
	r, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.Won || r.Claim.Fence != 3 {
		t.Fatalf("claim after the failure: %v fence %d %v; want won at fence 3 (released at 2)", r.Outcome, r.Claim.Fence, err)
	}
}

// A holder whose lease lapsed and who was replaced while its body ran
// commits nothing, and its delivery is a 503-style contention, never an
// ack.
func TestLockTxSupersededHolderCommitsNothing(t *testing.T) {
	ctx := t.Context()
	b, l, clock := newTxStore(t)
	var successor store.Claim
	err := idempotency.LockTx(ctx, b, "k", func(ctx context.Context, tx *ledgerTx) error {
		tx.rows = append(tx.rows, "zombie write")
		clock.Advance(2 * time.Minute) // the body outruns its lease
		r, err := b.Claim(ctx, "k", time.Minute)
		if err != nil || r.Outcome != store.Won {
			t.Fatalf("successor: %v %v", r.Outcome, err)
		}
		successor = r.Claim
		return nil
	}, idempotency.WithLease(time.Minute))
	if !errors.Is(err, idempotency.ErrInProgress) || idempotency.IsOwnDuplicate(err, "k") {
		t.Fatalf("LockTx of a superseded holder = %v, want an error wrapping ErrInProgress", err)
	}
	if got := l.committed(); len(got) != 0 {
		t.Fatalf("committed rows %q from a superseded holder", got)
	}
	if rec, _ := b.Record("k"); rec.State != store.Claimed || rec.Fence != successor.Fence {
		t.Fatalf("record %+v, want the successor's claim untouched", rec)
	}
}

func TestLockTxFailedCommitReleasesAndMarksNothing(t *testing.T) {
	ctx := t.Context()
	b, l, _ := newTxStore(t)
	refused := errors.New("could not serialize access")
	l.commitErr = refused
	err := idempotency.LockTx(ctx, b, "k", func(ctx context.Context, tx *ledgerTx) error {
		tx.rows = append(tx.rows, "row")
		return nil
	})
	if !errors.Is(err, refused) {
		t.Fatalf("LockTx = %v, want the commit's error", err)
	}
	if rec, _ := b.Record("k"); rec.State != store.Claimed || rec.Fence != 2 {
		t.Fatalf("record %+v, want claimed and released (fence 2)", rec)
	}
	if err := idempotency.LockTx(ctx, b, "k", func(ctx context.Context, tx *ledgerTx) error {
		tx.rows = append(tx.rows, "row")
		return nil
	}); err != nil {
		t.Fatalf("redelivery: %v", err)
	}
	if got := l.committed(); len(got) != 1 {
		t.Fatalf("committed rows %q, want one", got)
	}
}

// A commit whose outcome the backend could not settle is a failure (a
// nack), never an ack; the redelivery then finds the key done.
func TestLockTxUnsettledCommitIsNackedAndTheRedeliveryIsADuplicate(t *testing.T) {
	ctx := t.Context()
	b, l, _ := newTxStore(t)
	err := idempotency.LockTx(ctx, b, "k", func(ctx context.Context, tx *ledgerTx) error {
		tx.rows = append(tx.rows, "row")
		b.LoseNextReply()
		return nil
	})
	if !errors.Is(err, store.ErrCommitUnknown) {
		t.Fatalf("LockTx = %v, want ErrCommitUnknown", err)
	}
	ran := false
	if err := idempotency.LockTx(ctx, b, "k", func(context.Context, *ledgerTx) error { ran = true; return nil }); !idempotency.IsOwnDuplicate(err, "k") || ran {
		t.Fatalf("redelivery: %v (ran %v), want a duplicate", err, ran)
	}
	if got := l.committed(); len(got) != 1 {
		t.Fatalf("committed rows %q, want one", got)
	}
}

func TestLockTxPanicRollsBackReleasesAndGoesOn(t *testing.T) {
	ctx := t.Context()
	b, l, _ := newTxStore(t)
	func() {
		defer func() {
			if recover() != "boom" {
				t.Fatal("the panic did not go on")
			}
		}()
		idempotency.LockTx(ctx, b, "k", func(ctx context.Context, tx *ledgerTx) error {
			tx.rows = append(tx.rows, "row")
			panic("boom")
		})
	}()
	if got := l.committed(); len(got) != 0 {
		t.Fatalf("committed rows %q after a panic", got)
	}
	if rec, _ := b.Record("k"); rec.State != store.Claimed || rec.Fence != 2 {
		t.Fatalf("record %+v, want released (fence 2)", rec)
	}
}

// retryOnce is a TxStore whose store retries the first transaction, as
// Spanner does after an abort.
type retryOnce struct {
	*fake.TxStore[*ledgerTx]
}

var errAborted = errors.New("aborted")

func (r retryOnce) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(context.Context, *ledgerTx) error) (bool, error) {
	ok, err := r.TxStore.CompleteTx(ctx, c, fp, body)
	if errors.Is(err, errAborted) {
		return r.TxStore.CompleteTx(ctx, c, fp, body)
	}
	return ok, err
}

func TestLockTxRetriedByTheStoreCommitsOnce(t *testing.T) {
	ctx := t.Context()
	tb, l, _ := newTxStore(t)
	b := retryOnce{tb}
	calls := 0
	err := idempotency.LockTx(ctx, b, "k", func(ctx context.Context, tx *ledgerTx) error {
		calls++
		tx.rows = append(tx.rows, "row")
		if calls == 1 {
			return errAborted
		}
		return nil
	})
	if err != nil || calls != 2 {
		t.Fatalf("LockTx = %v after %d calls, want nil after 2", err, calls)
	}
	if got := l.committed(); len(got) != 1 {
		t.Fatalf("committed rows %q, want one", got)
	}
	if rec, _ := tb.Record("k"); rec.State != store.Done {
		t.Fatalf("record %+v, want done", rec)
	}
}

// Through the functions framework: the order is written and acked once,
// redeliveries are acked without running, and every failure is a nack.
func TestHTTPIdempotentTxOutcomes(t *testing.T) {
	b, l, _ := newTxStore(t)
	var (
		mu   sync.Mutex
		runs int
		fail error
	)
	h := func(ctx context.Context, e cloudevents.Event, tx *ledgerTx) error {
		mu.Lock()
		defer mu.Unlock()
		runs++
		tx.rows = append(tx.rows, e.ID())
		return fail
	}
	serve(t, idempotency.IdempotentTx(b, idempotency.WithLogger(newDiscard()))(h))
	fail = errors.New("downstream failed")
	if code, _ := post(t, "eventarc_binary"); code != http.StatusInternalServerError {
		t.Fatalf("failing handler: %d, want 500", code)
	}
	fail = nil
	l.commitErr = errors.New("commit refused")
	if code, _ := post(t, "eventarc_binary"); code != http.StatusInternalServerError {
		t.Fatalf("failed commit: %d, want 500", code)
	}
	for _, name := range []string{"eventarc_binary", "eventarc_structured", "push_raw"} {
		if code, body := post(t, name); code != http.StatusOK {
			t.Fatalf("%s: %d %s, want 200", name, code, body)
		}
	}
	if runs != 3 {
		t.Fatalf("handler ran %d times, want 3 (two failures, one success)", runs)
	}
	if got := l.committed(); len(got) != 1 || got[0] != fixtureID {
		t.Fatalf("committed rows %q, want the message once", got)
	}
}

func TestPushHandlerTxSupersededIs503(t *testing.T) {
	b, l, clock := newTxStore(t)
	h := func(ctx context.Context, e cloudevents.Event, tx *ledgerTx) error {
		tx.rows = append(tx.rows, e.ID())
		clock.Advance(time.Hour)
		if r, err := b.Claim(ctx, fixtureID, time.Minute); err != nil || r.Outcome != store.Won {
			t.Errorf("successor: %v %v", r.Outcome, err)
		}
		return nil
	}
	ph := idempotency.PushHandlerTx(b, h, idempotency.WithLease(time.Minute), idempotency.WithLogger(newDiscard()))
	_, body := fixture(t, "push_raw")
	if code := send(t, ph, string(body), map[string]string{"Content-Type": "application/json"}); code != http.StatusServiceUnavailable {
		t.Fatalf("superseded holder: %d, want 503", code)
	}
	if got := l.committed(); len(got) != 0 {
		t.Fatalf("committed rows %q from a superseded holder", got)
	}
}

func TestIdempotentTxRefusesWhatItCannotHonour(t *testing.T) {
	b, _, _ := newTxStore(t)
	func() {
		defer func() {
			if r := recover(); r == nil || !strings.Contains(r.(string), "AllowUnguarded") {
				t.Fatalf("IdempotentTx with AllowUnguarded: recovered %v, want a panic naming it", r)
			}
		}()
		idempotency.IdempotentTx(b, idempotency.AllowUnguarded())
	}()
	func() {
		defer func() {
			if r := recover(); r == nil || !strings.Contains(r.(string), "WithPushAuth") {
				t.Fatalf("IdempotentTx with WithPushAuth: recovered %v, want a panic naming it", r)
			}
		}()
		idempotency.IdempotentTx(b, idempotency.WithPushAuth(func(*http.Request) error { return nil }))
	}()
	t.Setenv(idempotency.DisableEnv, "1")
	ran := false
	f := idempotency.IdempotentTx(b, idempotency.WithLogger(newDiscard()))(func(context.Context, cloudevents.Event, *ledgerTx) error { ran = true; return nil })
	err := f(t.Context(), pubsubEvent(t, "m1", map[string]any{"data": ""}))
	if err == nil || ran || !strings.Contains(err.Error(), idempotency.DisableEnv) {
		t.Fatalf("with %s set: %v (ran %v), want a nack naming it and no run", idempotency.DisableEnv, err, ran)
	}
	if b.Calls(fake.OpClaim) != 0 {
		t.Fatal("the backend was called while disabled")
	}
}

// Under WithHeartbeat, a claim that an operator releases and another
// delivery takes while the body runs makes the renewal cancel the body;
// LockTx then answers ErrInProgress (PushHandlerTx: 503, a quiet nack),
// with the body's own context error kept in the chain, and nothing is
// committed. On 588c86c it answered the bare context error (a 500), both
// for a body that returns that error and for one that swallows it.
func TestLockTxSupersededUnderAHeartbeatIsInProgress(t *testing.T) {
	for _, swallow := range []bool{false, true} {
		b, l, _ := newTxStore(t)
		logs, logger := newLogs()
		err := idempotency.LockTx(t.Context(), b, "k", func(ctx context.Context, tx *ledgerTx) error {
			tx.rows = append(tx.rows, "write")
			c, _ := idempotency.ClaimFrom(ctx)
			if err := b.Release(context.Background(), c); err != nil { // idemctl release
				t.Errorf("release: %v", err)
			}
			if r, err := b.Claim(context.Background(), "k", time.Hour); err != nil || r.Outcome != store.Won {
				t.Errorf("the other delivery's claim: %v %v", r.Outcome, err)
			}
			<-ctx.Done() // the next renewal finds the claim lost
			if !errors.Is(context.Cause(ctx), store.ErrLost) {
				t.Errorf("cause %v, want ErrLost", context.Cause(ctx))
			}
			if swallow {
				return nil
			}
			return ctx.Err()
		}, idempotency.WithLease(time.Minute), idempotency.WithHeartbeat(idempotency.MinHeartbeat), idempotency.WithLogger(logger))
		var ip *idempotency.InProgressError
		if !errors.As(err, &ip) || !ip.Superseded || ip.Key != "k" {
			t.Fatalf("swallow=%v: LockTx = %v, want an *InProgressError with Superseded", swallow, err)
		}
		if !swallow && !errors.Is(err, context.Canceled) {
			t.Fatalf("LockTx = %v: the body's own error is not in the chain", err)
		}
		if strings.Contains(err.Error(), "held by another delivery") {
			t.Fatalf("LockTx = %v: it says the key is held, which nobody knows", err)
		}
		if got := l.committed(); len(got) != 0 {
			t.Fatalf("committed %q", got)
		}
		if len(logs.find(t, "ERROR", "")) != 0 || len(logs.find(t, "WARN", "superseded")) != 1 {
			t.Fatalf("logs: %v", logs.records(t))
		}
	}
}

// mirrorRenewal is a TxStore whose commit's reply arrives only after a
// lease renewal has found the key done: the renewal lands between the
// mark and the commit's reply, as on a loaded database.
type mirrorRenewal struct {
	*fake.TxStore[*ledgerTx]
	sawDone chan struct{}
	once    sync.Once
}

func (m *mirrorRenewal) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	next, err := m.TxStore.Extend(ctx, c, lease)
	if errors.Is(err, store.ErrLost) {
		m.once.Do(func() { close(m.sawDone) })
	}
	return next, err
}

func (m *mirrorRenewal) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(context.Context, *ledgerTx) error) (bool, error) {
	ok, err := m.TxStore.CompleteTx(ctx, c, fp, body)
	if ok {
		select {
		case <-m.sawDone:
		case <-time.After(30 * time.Second):
			return ok, errors.New("test: no renewal found the mark")
		}
	}
	return ok, err
}

// A renewal that finds the body's own Done mark before the commit's
// reply arrives is not a lost claim: the delivery committed and is
// acked, and nothing is logged at ERROR. On 588c86c the heartbeat logged
// "the claim was lost while the work ran ... cancelling the work".
func TestLockTxRenewalBetweenTheMarkAndTheReplyLogsNoError(t *testing.T) {
	b, l, _ := newTxStore(t)
	m := &mirrorRenewal{TxStore: b, sawDone: make(chan struct{})}
	logs, logger := newLogs()
	err := idempotency.LockTx(t.Context(), m, "k", func(ctx context.Context, tx *ledgerTx) error {
		tx.rows = append(tx.rows, "write")
		return nil
	}, idempotency.WithLease(time.Minute), idempotency.WithHeartbeat(idempotency.MinHeartbeat), idempotency.WithLogger(logger))
	if err != nil {
		t.Fatalf("LockTx = %v", err)
	}
	if got := l.committed(); len(got) != 1 {
		t.Fatalf("committed %q, want one row", got)
	}
	if e := logs.find(t, "ERROR", ""); len(e) != 0 {
		t.Fatalf("ERROR logged for a committed delivery: %v", e)
	}
}
