package spannerlock_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

	"cloud.google.com/go/spanner"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// The caller's own data for CompleteTx's tests: rows that carry an id,
// one new row per write (a second committed write shows as two).
const (
	txTable = "Effects"
	txDDL   = "CREATE TABLE " + txTable + " (id STRING(256) NOT NULL, n STRING(64) NOT NULL) PRIMARY KEY (id, n)"
)

// txDatabase creates a database of the test's own with the backend's
// table and the Effects table.
func txDatabase(t testing.TB) string {
	t.Helper()
	b, err := spannerlock.New(&spanner.Client{})
	if err != nil {
		t.Fatal(err)
	}
	return testsvc.SpannerDatabase(t, b.Schema(), txDDL)
}

// effect inserts one new Effects row carrying id, by DML: the statement
// begins the transaction on the server, as most bodies' first statement
// does.
func effect(ctx context.Context, tx *spanner.ReadWriteTransaction, id string) error {
	_, err := tx.Update(ctx, spanner.Statement{
		SQL:    "INSERT INTO " + txTable + " (id, n) VALUES (@id, @n)",
		Params: map[string]any{"id": id, "n": store.NewToken()},
	})
	return err
}

// readEffects counts the Effects rows carrying id in tx: a read of the
// body's own, which takes shared locks on what it reads.
func readEffects(ctx context.Context, tx *spanner.ReadWriteTransaction, id string) (int, error) {
	var n int64
	err := tx.Query(ctx, spanner.Statement{
		SQL:    "SELECT COUNT(*) FROM " + txTable + " WHERE id = @id",
		Params: map[string]any{"id": id},
	}).Do(func(r *spanner.Row) error { return r.Columns(&n) })
	return int(n), err
}

// endTx makes the emulator end tx under the body: one DML statement
// inserts the same primary key twice, which the emulator answers
// AlreadyExists; the emulator then holds the transaction failed: every
// later statement in it (the Done mark's UPDATE included) and its Commit
// fail with that same AlreadyExists, and nothing of it is applied. It
// returns the statement's error.
func endTx(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
	n := store.NewToken()
	_, err := tx.Update(ctx, spanner.Statement{
		SQL:    "INSERT INTO " + txTable + " (id, n) VALUES ('endtx', @n), ('endtx', @n)",
		Params: map[string]any{"n": n},
	})
	if err == nil {
		return errors.New("test: the emulator accepted a duplicate primary key")
	}
	return err
}

// effects counts the committed Effects rows carrying id, with a strong
// single read.
func effects(t testing.TB, c *spanner.Client, id string) int {
	t.Helper()
	var n int64
	err := c.Single().Query(context.Background(), spanner.Statement{
		SQL:    "SELECT COUNT(*) FROM " + txTable + " WHERE id = @id",
		Params: map[string]any{"id": id},
	}).Do(func(r *spanner.Row) error { return r.Columns(&n) })
	if err != nil {
		t.Fatalf("counting effects %q: %v", id, err)
	}
	return int(n)
}

// record is a row of the backend's table as read.
type record struct {
	state, fence      int64
	lease, exp        time.Time
	token             string
	fp                spanner.NullString
	present           bool
	serverNowAfterRow time.Time
}

// readRecord reads key's row with a strong read, and the server's
// CURRENT_TIMESTAMP() after it.
func readRecord(t testing.TB, c *spanner.Client, key string) record {
	t.Helper()
	var r record
	row, err := c.Single().ReadRow(context.Background(), spannerlock.DefaultTable, spanner.Key{[]byte(key)},
		[]string{"state", "fence", "lease_expiry", "expires_at", "token", "fingerprint"})
	switch {
	case spanner.ErrCode(err) == codes.NotFound:
	case err != nil:
		t.Fatalf("reading %q: %v", key, err)
	default:
		r.present = true
		if err := row.Columns(&r.state, &r.fence, &r.lease, &r.exp, &r.token, &r.fp); err != nil {
			t.Fatal(err)
		}
	}
	r.serverNowAfterRow = serverNow(t, c)
	return r
}

// serverNow is the emulator's CURRENT_TIMESTAMP().
func serverNow(t testing.TB, c *spanner.Client) time.Time {
	t.Helper()
	var now time.Time
	err := c.Single().Query(context.Background(), spanner.Statement{SQL: "SELECT CURRENT_TIMESTAMP()"}).
		Do(func(r *spanner.Row) error { return r.Columns(&now) })
	if err != nil {
		t.Fatal(err)
	}
	return now
}

// txEnv is a backend on a database with the Effects table, a second
// backend on another client of the same database (another instance), and
// a plain client to look with.
type txEnv struct {
	b, other *spannerlock.Backend
	client   *spanner.Client // b's, whose RPCs r counts
	r        *rpcs
	look     *spanner.Client
	proxy    *testsvc.DropProxy
}

func newTxEnv(t *testing.T, opts ...spannerlock.Option) txEnv {
	t.Helper()
	addr := testsvc.Spanner(t)
	db := txDatabase(t)
	p := testsvc.NewDropProxy(t, addr)
	r := &rpcs{}
	client := newClient(t, db, p.Addr(), r)
	b, err := spannerlock.New(client, opts...)
	if err != nil {
		t.Fatal(err)
	}
	other, err := spannerlock.New(newClient(t, db, addr, &rpcs{}), opts...)
	if err != nil {
		t.Fatal(err)
	}
	return txEnv{b: b, other: other, client: client, r: r, look: newClient(t, db, addr, &rpcs{}), proxy: p}
}

func (e txEnv) claim(t *testing.T, key string, lease time.Duration) store.Claim {
	t.Helper()
	res, err := e.b.Claim(t.Context(), key, lease)
	if err != nil || res.Outcome != store.Won {
		t.Fatalf("claim %q: %+v %v", key, res, err)
	}
	return res.Claim
}

// completeTx runs CompleteTx with a body that writes one effect carrying
// id, and returns its answer and how often the body ran.
func (e txEnv) completeTx(ctx context.Context, c store.Claim, fp, id string) (bool, int, error) {
	calls := 0
	ok, err := e.b.CompleteTx(ctx, c, fp, func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
		calls++
		return effect(ctx, tx, id)
	})
	return ok, calls, err
}

// The conformance cases of store.TxCompleter (storetest.RunTx) on the
// emulator, in real time, each case on a database of its own with the
// Effects table, reached through a DropProxy with Faults as TestContract's.
func TestContractTx(t *testing.T) {
	testsvc.Spanner(t)
	const ttl = 10 * time.Second
	storetest.RunTx(t, func(t *testing.T) storetest.TxHarness[*spanner.ReadWriteTransaction] {
		addr := testsvc.Spanner(t)
		db := txDatabase(t)
		p := testsvc.NewDropProxy(t, addr)
		r := &rpcs{}
		b, err := spannerlock.New(newClient(t, db, p.Addr(), r), spannerlock.WithTTL(ttl))
		if err != nil {
			t.Fatal(err)
		}
		look := newClient(t, db, addr, &rpcs{})
		return storetest.TxHarness[*spanner.ReadWriteTransaction]{
			Harness: storetest.Harness{Backend: b, TTL: ttl, Step: ttl / 10, Faults: faults{r: r, p: p}},
			Write:   effect,
			Count: func(ctx context.Context, id string) (int, error) {
				var n int64
				err := look.Single().Query(ctx, spanner.Statement{
					SQL:    "SELECT COUNT(*) FROM " + txTable + " WHERE id = @id",
					Params: map[string]any{"id": id},
				}).Do(func(r *spanner.Row) error { return r.Columns(&n) })
				return int(n), err
			},
			// The Spanner client runs the transaction again after a body
			// that returns Aborted.
			Retry: status.Error(codes.Aborted, "test: run the transaction again"),
			Read:  readEffects,
			EndTx: endTx,
		}
	})
}

// CompleteTx commits the body's writes and the Done mark together, and
// the mark is exactly the row CompleteFingerprint writes: state 2, the
// fingerprint, expires_at from the server's clock plus the ttl, fence,
// token and lease_expiry kept. A second CompleteTx of the same claim, and
// a CompleteTx of a claim Complete completed, commit nothing: false, nil.
func TestCompleteTxCommitsTheWritesAndTheMarkTogether(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	const ttl = time.Hour
	e := newTxEnv(t, spannerlock.WithTTL(ttl))
	for _, fp := range []string{"", "sha256:abc"} {
		t.Run("fp="+fp, func(t *testing.T) {
			tx, plain := e.claim(t, "tx"+fp, time.Minute), e.claim(t, "plain"+fp, time.Minute)
			before := readRecord(t, e.look, tx.Key)
			ok, calls, err := e.completeTx(ctx, tx, fp, "a"+fp)
			if !ok || err != nil || calls != 1 {
				t.Fatalf("CompleteTx = %v, %v (body ran %d times); want true, nil, once", ok, err, calls)
			}
			after := readRecord(t, e.look, tx.Key)
			if ok, err := e.b.CompleteFingerprint(ctx, plain, fp); !ok || err != nil {
				t.Fatalf("CompleteFingerprint: %v %v", ok, err)
			}
			want := readRecord(t, e.look, plain.Key)
			if n := effects(t, e.look, "a"+fp); n != 1 {
				t.Fatalf("%d effects after CompleteTx, want 1", n)
			}
			if after.state != want.state || after.fence != want.fence || after.fp != want.fp || after.token != tx.Token ||
				!after.lease.Equal(before.lease) || after.state != 2 || after.fence != tx.Fence {
				t.Errorf("CompleteTx left %+v, CompleteFingerprint %+v (the row before: %+v)", after, want, before)
			}
			// expires_at is the server's clock at the statement plus the
			// ttl, as CompleteFingerprint's.
			if lo, hi := before.serverNowAfterRow.Add(ttl), after.serverNowAfterRow.Add(ttl); after.exp.Before(lo) || after.exp.After(hi) {
				t.Errorf("CompleteTx's expires_at %v is not within [%v, %v], the server's clock around it plus the ttl", after.exp, lo, hi)
			}
			if res, err := e.other.Claim(ctx, tx.Key, time.Minute); err != nil || res.Outcome != store.AlreadyDone || res.Fingerprint != fp || !res.Until.Equal(after.exp) {
				t.Errorf("claim of the completed key: %+v %v; want done until %v with fingerprint %q", res, err, after.exp, fp)
			}

			ok, _, err = e.completeTx(ctx, tx, fp, "a"+fp)
			if ok || err != nil {
				t.Fatalf("second CompleteTx of the same claim = %v, %v; want false, nil", ok, err)
			}
			if n := effects(t, e.look, "a"+fp); n != 1 {
				t.Fatalf("%d effects after a second CompleteTx, want 1", n)
			}
			ok, _, err = e.completeTx(ctx, plain, fp, "b"+fp)
			if ok || err != nil {
				t.Fatalf("CompleteTx of a claim Complete completed = %v, %v; want false, nil", ok, err)
			}
			if n := effects(t, e.look, "b"+fp); n != 0 {
				t.Fatalf("%d effects from a CompleteTx of a completed claim, want 0", n)
			}
			if got := readRecord(t, e.look, tx.Key); !got.exp.Equal(after.exp) || got.state != 2 {
				t.Errorf("the refused CompleteTx changed the row: %+v, was %+v", got, after)
			}
		})
	}
}

// A holder whose lease lapsed and who was replaced cannot commit: its
// CompleteTx is false, nil and its writes are absent; the successor's
// claim is unaffected and its CompleteTx commits. A released claim's
// CompleteTx commits nothing either. A lapsed claim nobody took commits
// (the lease is not tested, as for Complete).
func TestCompleteTxOfASupersededHolderCommitsNothing(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	e := newTxEnv(t)
	old := e.claim(t, "k", time.Millisecond)
	time.Sleep(5 * time.Millisecond)
	res, err := e.other.Claim(ctx, "k", time.Minute)
	if err != nil || res.Outcome != store.Won || res.Claim.Fence != old.Fence+1 {
		t.Fatalf("the successor's claim: %+v %v", res, err)
	}
	if ok, _, err := e.completeTx(ctx, old, "", "old"); ok || err != nil {
		t.Fatalf("the superseded holder's CompleteTx = %v, %v; want false, nil", ok, err)
	}
	if n := effects(t, e.look, "old"); n != 0 {
		t.Fatalf("the superseded holder's CompleteTx left %d effects, want 0", n)
	}
	if r := readRecord(t, e.look, "k"); r.state != 1 || r.fence != res.Claim.Fence || r.token != res.Claim.Token {
		t.Fatalf("the successor's row after the refused CompleteTx: %+v", r)
	}
	if ok, err := e.other.CompleteTx(ctx, res.Claim, "", func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
		return effect(ctx, tx, "new")
	}); !ok || err != nil {
		t.Fatalf("the successor's CompleteTx = %v, %v", ok, err)
	}
	if n := effects(t, e.look, "new"); n != 1 {
		t.Fatalf("the successor's CompleteTx left %d effects, want 1", n)
	}

	rel := e.claim(t, "released", time.Minute)
	if err := e.b.Release(ctx, rel); err != nil {
		t.Fatal(err)
	}
	if ok, _, err := e.completeTx(ctx, rel, "", "released"); ok || err != nil || effects(t, e.look, "released") != 0 {
		t.Fatalf("CompleteTx of a released claim = %v, %v; want false, nil and no effect", ok, err)
	}

	lapsed := e.claim(t, "lapsed", time.Millisecond)
	time.Sleep(5 * time.Millisecond)
	if ok, _, err := e.completeTx(ctx, lapsed, "", "lapsed"); !ok || err != nil || effects(t, e.look, "lapsed") != 1 {
		t.Fatalf("CompleteTx of a lapsed claim nobody took = %v, %v; want true, nil and the effect", ok, err)
	}
}

// A body error rolls back: the error wraps the body's, no effect and no
// mark exist, and the claim can be released and the key claimed again.
func TestCompleteTxBodyErrorLeavesNoWritesAndNoMark(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	e := newTxEnv(t)
	c := e.claim(t, "k", time.Minute)
	boom := errors.New("boom")
	ok, err := e.b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
		if err := effect(ctx, tx, "k"); err != nil {
			return err
		}
		return fmt.Errorf("the body: %w", boom)
	})
	if ok || !errors.Is(err, boom) {
		t.Fatalf("CompleteTx with a failing body = %v, %v; want false and an error wrapping boom", ok, err)
	}
	if n := effects(t, e.look, "k"); n != 0 {
		t.Fatalf("%d effects after a body error, want 0", n)
	}
	if r := readRecord(t, e.look, "k"); r.state != 1 || r.fence != c.Fence {
		t.Fatalf("the row after a body error: %+v; want still claimed with fence %d", r, c.Fence)
	}
	if res, err := e.other.Claim(ctx, "k", time.Minute); err != nil || res.Outcome != store.HeldByOther {
		t.Fatalf("claim after a body error: %+v %v; want held by other", res, err)
	}
	if err := e.b.Release(ctx, c); err != nil {
		t.Fatal(err)
	}
	if res, err := e.other.Claim(ctx, "k", time.Minute); err != nil || res.Outcome != store.Won || res.Claim.Fence <= c.Fence {
		t.Fatalf("claim after the release: %+v %v; want won with a higher fence", res, err)
	}
}

// Arguments are checked before any RPC, and the body does not run.
func TestCompleteTxValidatesBeforeAnyIO(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	e := newTxEnv(t)
	c := e.claim(t, "k", time.Minute)
	e.r.take()
	body := func(context.Context, *spanner.ReadWriteTransaction) error {
		t.Error("the body ran for invalid arguments")
		return nil
	}
	if _, err := e.b.CompleteTx(ctx, store.Claim{Fence: 1, Token: "x"}, "", body); !errors.Is(err, store.ErrInvalidKey) {
		t.Errorf("empty key: %v, want ErrInvalidKey", err)
	}
	if _, err := e.b.CompleteTx(ctx, c, "bad\x00fp", body); !errors.Is(err, store.ErrInvalidFingerprint) {
		t.Errorf("invalid fingerprint: %v, want ErrInvalidFingerprint", err)
	}
	if sent := e.r.take(); len(sent) != 0 {
		t.Errorf("invalid arguments sent %v", sent)
	}
}

// A transaction the Spanner client runs again (the body returned Aborted
// once, as a statement of Spanner's would) commits the writes once: only
// the committing attempt's writes exist.
func TestCompleteTxRetriedByTheClientCommitsTheWritesOnce(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	e := newTxEnv(t)
	c := e.claim(t, "k", time.Minute)
	calls := 0
	ok, err := e.b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
		calls++
		if err := effect(ctx, tx, "k"); err != nil {
			return err
		}
		if calls == 1 {
			return status.Error(codes.Aborted, "test: abort the first attempt after its write")
		}
		return nil
	})
	if !ok || err != nil || calls != 2 {
		t.Fatalf("CompleteTx whose first attempt aborted = %v, %v, body ran %d times; want true, nil, twice", ok, err, calls)
	}
	if n := effects(t, e.look, "k"); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}

// A Commit that applied but whose reply was lost is settled before
// CompleteTx answers: true, with the effect once and the row Done. The
// loss comes back as Unavailable (the Spanner client sends the Commit
// again), as DeadlineExceeded or NotFound (it reaches the backend, which
// settles by releasing the claim and reading the row), as Aborted (the
// client runs the function again, whose Done mark finds the row done by
// this very claim), as NotFound naming the transaction (the backend runs
// the transaction again, with the same finding), and as a ctx that the
// caller cancels meanwhile (the settling runs on a context of its own).
func TestCompleteTxWithALostCommitReplyThatLandedIsTrue(t *testing.T) {
	t.Parallel()
	for _, lost := range []string{"Unavailable", "DeadlineExceeded", "NotFound", "Aborted", "TransactionNotFound", "Canceled"} {
		t.Run(lost, func(t *testing.T) {
			t.Parallel()
			e := newTxEnv(t)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			c := e.claim(t, "k", time.Minute)
			switch lost {
			case "Canceled":
				e.r.lostCode = codes.Canceled
				e.r.whileLost = cancel
			case "TransactionNotFound":
				e.r.lostCode, e.r.lostMsg = codes.NotFound, "Transaction not found: 7"
			default:
				e.r.lostCode = map[string]codes.Code{"Unavailable": codes.Unavailable, "DeadlineExceeded": codes.DeadlineExceeded,
					"NotFound": codes.NotFound, "Aborted": codes.Aborted}[lost]
			}
			e.r.loseNextCommit.Store(true)
			ok, calls, err := e.completeTx(ctx, c, "", "k")
			if e.r.lost.Load() != 1 {
				t.Fatalf("%d replies lost, want 1", e.r.lost.Load())
			}
			t.Logf("body ran %d times; RPCs %v", calls, e.r.take())
			if !ok || err != nil {
				t.Fatalf("CompleteTx whose commit landed, its reply lost as %s = %v, %v; want true, nil", lost, ok, err)
			}
			if n := effects(t, e.look, "k"); n != 1 {
				t.Fatalf("%d effects, want 1", n)
			}
			if r := readRecord(t, e.look, "k"); r.state != 2 || r.fence != c.Fence || r.token != c.Token {
				t.Fatalf("the row: %+v; want done with the claim's fence and token", r)
			}
		})
	}
}

// A Commit that failed without landing (refused before it was sent, with
// an error that reaches the backend) is settled too: an error that is not
// ErrCommitUnknown, no effect, and the claim released (the key can be
// claimed at once, with a higher fence).
func TestCompleteTxWithACommitThatDidNotLandFailsAndReleases(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	e := newTxEnv(t)
	c := e.claim(t, "k", time.Minute)
	e.r.refuse.Store(&refusal{method: "Commit", code: codes.DeadlineExceeded})
	ok, calls, err := e.completeTx(ctx, c, "", "k")
	if e.r.refused.Load() != 1 {
		t.Fatalf("%d Commits refused, want 1", e.r.refused.Load())
	}
	t.Logf("body ran %d times; RPCs %v", calls, e.r.take())
	if ok || err == nil || errors.Is(err, store.ErrCommitUnknown) || spanner.ErrCode(err) != codes.DeadlineExceeded {
		t.Fatalf("CompleteTx whose Commit never reached the server = %v, %v; want false and the Commit's error, not ErrCommitUnknown", ok, err)
	}
	if n := effects(t, e.look, "k"); n != 0 {
		t.Fatalf("%d effects, want 0", n)
	}
	res, err := e.other.Claim(ctx, "k", time.Minute)
	if err != nil || res.Outcome != store.Won || res.Claim.Fence <= c.Fence {
		t.Fatalf("claim after the settled CompleteTx: %+v %v; want won with a fence above %d", res, err, c.Fence)
	}
}

// When the settling fails too, CompleteTx returns an error wrapping
// ErrCommitUnknown, never true or false; the effect and the Done mark
// exist both or neither (here both: the Commit landed).
func TestCompleteTxThatCannotSettleReturnsErrCommitUnknown(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	e := newTxEnv(t)
	c := e.claim(t, "k", time.Minute)
	e.r.lostCode = codes.DeadlineExceeded
	e.r.whileLost = func() {
		// The settling's Release fails at its Commit, with a code no
		// layer retries (a refused first statement would be sent again
		// with an explicit BeginTransaction).
		e.r.refuse.Store(&refusal{method: "Commit", code: codes.PermissionDenied})
	}
	e.r.loseNextCommit.Store(true)
	ok, _, err := e.completeTx(ctx, c, "", "k")
	if e.r.lost.Load() != 1 || e.r.refused.Load() != 1 {
		t.Fatalf("%d replies lost and %d statements refused, want 1 and 1", e.r.lost.Load(), e.r.refused.Load())
	}
	if ok || !errors.Is(err, store.ErrCommitUnknown) {
		t.Fatalf("CompleteTx that could not settle = %v, %v; want an error wrapping ErrCommitUnknown", ok, err)
	}
	n, r := effects(t, e.look, "k"), readRecord(t, e.look, "k")
	if done := r.state == 2 && r.fence == c.Fence && r.token == c.Token; done != (n == 1) || n > 1 {
		t.Fatalf("%d effects and the row %+v: want the effect exactly when the claim is done", n, r)
	}
}

// A crash between the body's last write and the commit leaves neither
// the effect nor the mark: the caller's ctx ends there (the Done mark's
// statement fails with it, and nothing commits), or the connections are
// cut there (whatever CompleteTx answers, true means the effect exists,
// false or an error that it does not, and it exists exactly when the key
// is done).
func TestCompleteTxCrashBeforeTheCommitLeavesNeither(t *testing.T) {
	t.Parallel()
	t.Run("ctx", func(t *testing.T) {
		t.Parallel()
		e := newTxEnv(t)
		c := e.claim(t, "k", time.Minute)
		ctx, cancel := context.WithCancel(t.Context())
		ok, err := e.b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
			if err := effect(ctx, tx, "k"); err != nil {
				return err
			}
			cancel()
			return nil
		})
		if ok || !errors.Is(err, context.Canceled) && spanner.ErrCode(err) != codes.Canceled {
			t.Fatalf("CompleteTx whose ctx ended before the commit = %v, %v; want false and the ctx's error", ok, err)
		}
		if n := effects(t, e.look, "k"); n != 0 {
			t.Fatalf("%d effects, want 0", n)
		}
		if r := readRecord(t, e.look, "k"); r.state != 1 || r.fence != c.Fence {
			t.Fatalf("the row: %+v; want still claimed with fence %d", r, c.Fence)
		}
	})
	t.Run("cut", func(t *testing.T) {
		t.Parallel()
		e := newTxEnv(t)
		ctx := t.Context()
		for i := range 3 {
			key := fmt.Sprint("k", i)
			c := e.claim(t, key, time.Minute)
			calls := 0
			ok, err := e.b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
				calls++
				if err := effect(ctx, tx, key); err != nil {
					return err
				}
				if calls == 1 {
					e.proxy.CutConnections()
				}
				return nil
			})
			n, r := effects(t, e.look, key), readRecord(t, e.look, key)
			t.Logf("cut after the write: %v, %v; body ran %d times; %d effects", ok, err, calls, n)
			done := r.state == 2 && r.fence == c.Fence && r.token == c.Token
			switch {
			case done != (n == 1) || n > 1:
				t.Fatalf("%d effects and the row %+v: want the effect exactly when the claim is done", n, r)
			case ok && n != 1, !ok && err == nil, err != nil && !errors.Is(err, store.ErrCommitUnknown) && n != 0:
				t.Fatalf("CompleteTx = %v, %v with %d effects", ok, err, n)
			}
		}
	})
}

// While a body runs (its transaction begun by its write), a concurrent
// Claim of the key on another instance answers HeldByOther without
// waiting for the body's transaction: the body waits for that answer
// (up to a bound that only detects a deadlock) before it returns.
//
// On the emulator the answer comes at once, but at a cost to the body:
// the emulator runs one read-write transaction per database, and the
// Claim's takes priority and aborts the body's, which the Spanner client
// then runs again. The test logs how long the Claim took and how often
// the body ran.
func TestCompleteTxDoesNotBlockAConcurrentClaim(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	e := newTxEnv(t)
	c := e.claim(t, "k", time.Minute)
	type answer struct {
		res  store.Result
		err  error
		took time.Duration
	}
	var (
		first *answer
		calls int
	)
	ok, err := e.b.CompleteTx(ctx, c, "", func(txCtx context.Context, tx *spanner.ReadWriteTransaction) error {
		calls++
		if err := effect(txCtx, tx, "k"); err != nil {
			return err
		}
		if first != nil {
			return nil
		}
		got := make(chan answer, 1)
		go func() {
			// Not txCtx: the Spanner client refuses a transaction
			// under the context of another (nested transactions).
			start := time.Now()
			res, err := e.other.Claim(ctx, "k", time.Minute)
			got <- answer{res, err, time.Since(start)}
		}()
		select {
		case a := <-got:
			first = &a
			return nil
		case <-time.After(30 * time.Second):
			return errors.New("a concurrent Claim did not answer while the body ran")
		}
	})
	if !ok || err != nil {
		t.Fatalf("CompleteTx = %v, %v", ok, err)
	}
	if first.err != nil || first.res.Outcome != store.HeldByOther {
		t.Fatalf("the Claim while the body ran: %+v %v; want held by other", first.res, first.err)
	}
	t.Logf("the concurrent Claim answered in %v; the body ran %d times", first.took, calls)
	if n := effects(t, e.look, "k"); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}

// A body error that says the transaction is gone (NotFound naming it, as
// the emulator answers a transaction it dropped) makes the backend run the
// transaction again, and the writes commit once; any other body error that
// is not Aborted is returned at once (WithRetries does not apply), the body
// having run once.
func TestCompleteTxRunsAgainAfterALostTransactionOnly(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	e := newTxEnv(t)
	for _, c := range []struct {
		err   error
		calls int
	}{
		{status.Error(codes.NotFound, "Transaction not found: 7"), 2},
		{status.Error(codes.Unavailable, "test: a transient failure in the body"), 1},
	} {
		code := status.Code(c.err)
		cl := e.claim(t, code.String(), time.Minute)
		calls := 0
		ok, err := e.b.CompleteTx(ctx, cl, "", func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
			calls++
			if err := effect(ctx, tx, code.String()); err != nil {
				return err
			}
			if calls == 1 {
				return c.err
			}
			return nil
		})
		if calls != c.calls {
			t.Errorf("%v: the body ran %d times, want %d", code, calls, c.calls)
		}
		n := effects(t, e.look, code.String())
		if c.calls == 2 && (!ok || err != nil || n != 1) {
			t.Errorf("%v: CompleteTx = %v, %v with %d effects; want true, nil, 1", code, ok, err, n)
		}
		if c.calls == 1 && (ok || spanner.ErrCode(err) != code || n != 0) {
			t.Errorf("%v: CompleteTx = %v, %v with %d effects; want false, the body's error, 0", code, ok, err, n)
		}
	}
}

// The Done mark is one statement in the caller's transaction: a body with
// one statement costs that statement, the mark's ExecuteSql and the
// Commit, one RPC fewer than the same transaction followed by a plain
// Complete.
func TestCompleteTxRPCs(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	e := newTxEnv(t)
	c, d := e.claim(t, "tx", time.Minute), e.claim(t, "plain", time.Minute)
	e.r.take()
	if ok, _, err := e.completeTx(ctx, c, "", "tx"); !ok || err != nil {
		t.Fatalf("CompleteTx: %v %v", ok, err)
	}
	tx := e.r.take()
	if want := []string{"ExecuteSql", "ExecuteSql", "Commit"}; !slices.Equal(tx, want) {
		t.Errorf("CompleteTx sent %v, want %v", tx, want)
	}
	if _, err := e.client.ReadWriteTransaction(ctx, func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
		return effect(ctx, tx, "plain")
	}); err != nil {
		t.Fatal(err)
	}
	if ok, err := e.b.Complete(ctx, d); !ok || err != nil {
		t.Fatalf("Complete: %v %v", ok, err)
	}
	if plain := e.r.take(); len(plain) != len(tx)+1 {
		t.Errorf("a transaction and a plain Complete sent %v: want one RPC more than CompleteTx's %v", plain, tx)
	}
}

// The Spanner client refuses another read-write transaction under the
// body's ctx (it does not nest transactions): the body does its
// database's work in tx.
func TestCompleteTxBodyCannotNestATransaction(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	e := newTxEnv(t)
	c := e.claim(t, "k", time.Minute)
	var nested error
	ok, err := e.b.CompleteTx(ctx, c, "", func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
		_, nested = e.look.ReadWriteTransaction(ctx, func(context.Context, *spanner.ReadWriteTransaction) error { return nil })
		return effect(ctx, tx, "k")
	})
	if !ok || err != nil {
		t.Fatalf("CompleteTx: %v %v", ok, err)
	}
	if spanner.ErrCode(nested) != codes.FailedPrecondition {
		t.Fatalf("a transaction under the body's ctx: %v, want FailedPrecondition (nested transactions)", nested)
	}
}

// crashChildEnv names, in the environment of a child of
// TestCompleteTxKilledBeforeTheCommitLeavesNeither, the key it claims
// (HELPER_DB names the database).
const crashChildEnv = "SPANNERLOCK_CRASH_CHILD"

// crashChild claims the key, runs CompleteTx with a body that writes one
// effect carrying the key, says "written" on stdout and waits to be
// killed. It returns an exit code for TestMain.
func crashChild() int {
	ctx := context.Background()
	key := os.Getenv(crashChildEnv)
	b, err := spannerlock.Dial(ctx, os.Getenv("HELPER_DB"))
	if err != nil {
		fmt.Println(err)
		return 1
	}
	res, err := b.Claim(ctx, key, 2*time.Second)
	if err != nil || res.Outcome != store.Won {
		fmt.Println("claim:", res.Outcome, err)
		return 1
	}
	_, err = b.CompleteTx(ctx, res.Claim, "", func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
		if err := effect(ctx, tx, key); err != nil {
			return err
		}
		fmt.Println("written")
		select {} // SIGKILL comes here, before the Done mark and the commit
	})
	fmt.Println("CompleteTx returned:", err)
	return 1
}

// A process killed (SIGKILL) between the body's last write and the commit
// leaves neither the effect nor the Done mark: the key stays claimed until
// the lease lapses, and the next delivery claims it with a higher fence
// and commits its own effect, once.
func TestCompleteTxKilledBeforeTheCommitLeavesNeither(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	e := newTxEnv(t)
	db := e.look.DatabaseName()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), crashChildEnv+"=k", "HELPER_DB="+db)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if line != "written\n" {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("the child said %q (%v), want written", line, err)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	if n := effects(t, e.look, "k"); n != 0 {
		t.Fatalf("%d effects after the kill, want 0", n)
	}
	r := readRecord(t, e.look, "k")
	if r.state != 1 || r.fence != 1 {
		t.Fatalf("the row after the kill: %+v; want claimed with fence 1", r)
	}
	time.Sleep(time.Until(r.lease) + 10*time.Millisecond)
	res, err := e.other.Claim(ctx, "k", time.Minute)
	if err != nil || res.Outcome != store.Won || res.Claim.Fence != 2 {
		t.Fatalf("the next delivery's claim: %+v %v; want won with fence 2", res, err)
	}
	if ok, err := e.other.CompleteTx(ctx, res.Claim, "", func(ctx context.Context, tx *spanner.ReadWriteTransaction) error {
		return effect(ctx, tx, "k")
	}); !ok || err != nil {
		t.Fatalf("the next delivery's CompleteTx: %v %v", ok, err)
	}
	if n := effects(t, e.look, "k"); n != 1 {
		t.Fatalf("%d effects after the next delivery, want 1", n)
	}
}
