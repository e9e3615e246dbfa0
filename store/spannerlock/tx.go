package spannerlock

import (
	"context"
	"errors"
	"fmt"
	"time"

	"cloud.google.com/go/spanner"
	"google.golang.org/grpc/codes"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var _ store.TxBackend[*spanner.ReadWriteTransaction] = (*Backend)(nil)

// errFenced ends a CompleteTx attempt whose claim no longer holds the
// record: the transaction is rolled back and the call returns false.
var errFenced = errors.New("spannerlock: the record is not claimed with this claim's fence and token")

// errLanded ends a CompleteTx attempt that found the record already Done
// with the claim's fence and token after an earlier attempt of the same
// call had tried to commit: that commit landed (Spanner's answer to it was
// lost or wrong), so this attempt is rolled back and the call returns true.
var errLanded = errors.New("spannerlock: an earlier attempt of this call committed")

// settleTimeout bounds the operation that settles a commit whose reply was
// lost. It runs on a context detached from the caller's cancellation: the
// caller's ending context is often why the reply was lost.
const settleTimeout = 30 * time.Second

// Phases of one CompleteTx attempt, to tell where an error came from.
const (
	phaseStart  = iota // before the function runs (taking a session)
	phaseBody          // the caller's body runs
	phaseMark          // the conditional UPDATE that writes the Done mark
	phaseCommit        // the function returned nil: the client commits
)

// CompleteTx completes c in the caller's own read-write transaction: it
// runs body in a transaction of the backend's client
// ([spanner.Client.ReadWriteTransaction]), then, in the same transaction,
// one DML statement moves c's row to Done exactly as
// [Backend.CompleteFingerprint] does (state 2, expires_at =
// CURRENT_TIMESTAMP() + the ttl, fingerprint = fp or NULL when fp is
// empty; fence, token and lease_expiry unchanged), if the row is Claimed
// with c's fence and token, and the transaction commits once. The body's
// writes and the Done mark therefore commit together or not at all. The
// lease is not tested, as for Complete. It implements
// [store.TxCompleter]:
//
//   - It validates c.Key and fp before any I/O (errors wrapping
//     store.ErrInvalidKey, store.ErrInvalidFingerprint).
//   - It returns true, nil only when the transaction committed.
//   - When the row is not Claimed with c's fence and token (replaced,
//     released, completed already, by CompleteTx or Complete), the
//     statement matches nothing and the transaction is rolled back:
//     false, nil, and none of the body's writes exist.
//   - When body panics, the transaction is rolled back (the Spanner
//     client ends it with a Rollback, releasing its locks at once), and
//     the panic goes on with body's own value; c's row is left as it
//     was, for the caller to release.
//   - When body returns an error, the transaction is rolled back and the
//     error returned wraps body's. A body error whose code is Aborted
//     (or that wraps one) is the exception: the Spanner client runs the
//     transaction again, as below.
//   - The body may run more than once: the Spanner client runs the whole
//     function again, with a fresh transaction, after Spanner aborts the
//     transaction (at any statement, or at the commit) or the body
//     returns Aborted; and the backend runs it again, up to 100 times
//     within ctx, after a statement or the Commit finds the transaction
//     gone (NotFound or FailedPrecondition naming the transaction: how
//     the emulator answers a transaction that a concurrent one aborted).
//     Only the writes of the attempt that commits exist. Whatever body
//     does outside the transaction (calls to other services, messages
//     sent) may happen once per attempt. [WithRetries] does not apply:
//     a body's failure other than those is returned, not retried.
//   - An attempt that follows one whose Commit was tried (and answered
//     Aborted, or the transaction gone), and whose Done mark then finds
//     the row Done with c's fence and token, learns that the earlier
//     Commit landed after all: it is rolled back and the call returns
//     true, nil. Serializable transactions keep the two from both
//     committing: each reads the row Claimed and writes it Done.
//   - When the Commit fails otherwise (its reply lost: Unavailable after
//     the client's resends, DeadlineExceeded, a cancelled ctx, or any
//     other error), it settles before it returns, on a context detached
//     from ctx's cancellation, for at most 30 seconds: it releases c (as
//     [Backend.Release]: only a row still Claimed with c's fence and
//     token, whose fence it raises, so that a commit still in flight can
//     no longer land), then reads the row with a strong read. Done with
//     c's fence and token: true, nil. Otherwise the Commit's error
//     (nothing committed, and c is released). When the settling itself
//     fails, an error wrapping [store.ErrCommitUnknown]: the body's
//     writes and the Done mark both exist or neither does.
//   - It takes no lock on c's row before body returns: the Done mark is
//     the transaction's last statement, so on Spanner a concurrent Claim
//     of the key is answered HeldByOther while body runs (unless body
//     itself reads the backend's table). The Spanner emulator is not
//     Spanner: it runs one read-write transaction at a time per
//     database. A call on that database while body's transaction is open
//     is aborted and run again by the Spanner client until the emulator,
//     which at each such conflict aborts the open transaction instead
//     one time in five, aborts body's: the call then answers (a Claim
//     HeldByOther, about 0.15 s after it began in this package's tests)
//     and body runs again. On a busy emulator database a body can be
//     aborted many times over. A renewal of c itself ([Backend.Extend],
//     a heartbeat's) would so abort body's transaction at every renewal:
//     on the emulator (SPANNER_EMULATOR_HOST set when the Backend was
//     built) it waits until this call returns instead.
//   - The transaction runs under ctx: a ctx that ends before the commit
//     ends the attempt with ctx's error, and nothing is written.
//
// Limits are Spanner's for one transaction: at most 80,000 mutations per
// commit of buffered writes and per DML statement (every column written,
// plus index entries; the Done mark's statement changes one row), at most
// 100 MiB in all, and a transaction idle for about 10 seconds may be
// aborted. A body holds the locks it took until the commit, and Spanner
// aborts (and the client reruns) one of two transactions that want the
// same rows: keep bodies short. The transaction is the client's default
// kind (serializable unless the client was configured otherwise); the
// Done mark is one statement, so its check and its write are atomic under
// either isolation level. Inside body, use tx (and body's ctx) for the
// database's work: the Spanner client refuses another transaction under
// body's ctx (nested transactions).
//
// Cost: the Done mark adds one ExecuteSql round trip to the body's own
// statements and Commit (one RPC fewer than a plain Complete after the
// caller's own transaction).
func (b *Backend) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(ctx context.Context, tx *spanner.ReadWriteTransaction) error) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, fmt.Errorf("spannerlock: complete %q fence %d in a transaction: %w", c.Key, c.Fence, err)
	}
	if err := store.ValidateFingerprint(fp); err != nil {
		return false, fmt.Errorf("spannerlock: complete %q fence %d in a transaction: %w", c.Key, c.Fence, err)
	}
	defer b.enterTx(c)()
	p := b.params(c)
	p["fp"] = spanner.NullString{StringVal: fp, Valid: fp != ""}
	mark := spanner.Statement{
		SQL: "UPDATE " + b.table + " SET state = 2, " +
			"expires_at = TIMESTAMP_ADD(CURRENT_TIMESTAMP(), INTERVAL @ttl MICROSECOND), " +
			"fingerprint = @fp" + guard + " AND state = 1",
		Params: p,
	}
	var (
		phase int
		// tried: an attempt's function returned nil, so the client tried
		// to commit it. When the function runs again after that, the
		// client was told that commit aborted.
		tried bool
	)
	// panicked is the value the body panicked with: the attempt's
	// transaction is rolled back (the Spanner client does so for a
	// function that returns an error; a panic would leave it open on
	// the server, holding its locks until Spanner ends it for
	// idleness), then the panic goes on with it.
	var panicked *bodyPanic
	fn := func(ctx context.Context, tx *spanner.ReadWriteTransaction) (err error) {
		phase = phaseBody
		err = func() (err error) {
			defer func() {
				if v := recover(); v != nil {
					panicked = &bodyPanic{v}
					err = panicked
				}
			}()
			return body(context.WithValue(ctx, inBody{}, true), tx)
		}()
		if err != nil {
			return err
		}
		phase = phaseMark
		n, err := tx.Update(ctx, mark)
		if err != nil {
			return err
		}
		if n == 0 {
			if tried {
				return b.landed(ctx, tx, c)
			}
			return errFenced
		}
		phase, tried = phaseCommit, true
		return nil
	}
	for n := 0; ; n++ {
		phase = phaseStart
		_, err := b.client.ReadWriteTransaction(ctx, fn)
		if panicked != nil {
			panic(panicked.v)
		}
		switch {
		case err == nil, errors.Is(err, errLanded):
			return true, nil
		case errors.Is(err, errFenced):
			return false, nil
		case phase == phaseCommit && !txLost(err):
			return b.settle(ctx, c, err)
		case txLost(err) && n < maxLost && ctx.Err() == nil:
			// The transaction is gone (at the commit too: how the
			// emulator answers a transaction a concurrent one aborted):
			// run it again. Should that commit have landed after all,
			// the next attempt's Done mark finds the row Done by c
			// (tried is set) and ends with errLanded.
			if b.policy.Wait(ctx, min(n, 6)) == nil {
				continue
			}
		}
		if phase == phaseCommit {
			return b.settle(ctx, c, err)
		}
		if phase == phaseBody {
			return false, fmt.Errorf("spannerlock: complete %q fence %d in a transaction: the body failed: %w", c.Key, c.Fence, err)
		}
		return false, fmt.Errorf("spannerlock: complete %q fence %d in a transaction: %w", c.Key, c.Fence, err)
	}
}

// bodyPanic carries the value a CompleteTx body panicked with out of the
// Spanner client's transaction, as the error that makes it roll back.
type bodyPanic struct{ v any }

func (p *bodyPanic) Error() string { return fmt.Sprintf("spannerlock: the body panicked: %v", p.v) }

// txClaim names a claim by what identifies it: a renewal changes its
// lease expiry.
type txClaim struct {
	key, token string
	fence      int64
}

// txGate is the CompleteTx calls of one claim running in a Backend.
type txGate struct {
	n    int
	done chan struct{} // closed when the last returns
}

// enterTx marks a CompleteTx of c as running, on the emulator, until the
// returned function is called: Extend of c waits for it meanwhile (see
// [Backend.Extend]). Elsewhere it does nothing.
func (b *Backend) enterTx(c store.Claim) (leave func()) {
	if !b.emulator {
		return func() {}
	}
	id := txClaim{c.Key, c.Token, c.Fence}
	b.inTxMu.Lock()
	defer b.inTxMu.Unlock()
	if b.inTx == nil {
		b.inTx = map[txClaim]*txGate{}
	}
	g := b.inTx[id]
	if g == nil {
		g = &txGate{done: make(chan struct{})}
		b.inTx[id] = g
	}
	g.n++
	return func() {
		b.inTxMu.Lock()
		defer b.inTxMu.Unlock()
		if g.n--; g.n == 0 {
			delete(b.inTx, id)
			close(g.done)
		}
	}
}

// inBody is the key of a value on a CompleteTx body's context.
type inBody struct{}

// errTxRunning ends an Extend, on the emulator, that waited for its
// claim's CompleteTx until the claim's lease expiry: running it would
// abort the body's transaction, and make the body run again.
var errTxRunning = errors.New("spannerlock: the claim's CompleteTx is still running past the lease, and the emulator would abort its transaction for this renewal's")

// awaitTx waits, on the emulator, until no CompleteTx of c is running in
// this Backend (nil), ctx ends (its error), or c's lease expiry passes
// (errTxRunning). It does not wait on a CompleteTx body's own context:
// the call is then inside the body, which waits for it (and the Spanner
// client refuses the nested transaction).
func (b *Backend) awaitTx(ctx context.Context, c store.Claim) error {
	if !b.emulator || ctx.Value(inBody{}) != nil {
		return nil
	}
	id := txClaim{c.Key, c.Token, c.Fence}
	lapse := time.NewTimer(time.Until(c.LeaseExpiry))
	defer lapse.Stop()
	for {
		b.inTxMu.Lock()
		g := b.inTx[id]
		b.inTxMu.Unlock()
		if g == nil {
			return nil
		}
		select {
		case <-g.done:
		case <-lapse.C:
			return errTxRunning
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// landed reads c's row in tx, after the Done mark matched nothing in an
// attempt that followed a Commit the client was told aborted: errLanded
// when the row is Done with c's fence and token (that Commit landed),
// errFenced otherwise.
func (b *Backend) landed(ctx context.Context, tx *spanner.ReadWriteTransaction, c store.Claim) error {
	r, err := tx.ReadRow(ctx, b.table, spanner.Key{[]byte(c.Key)}, []string{"state", "fence", "token"})
	if spanner.ErrCode(err) == codes.NotFound {
		return errFenced
	}
	if err != nil {
		return err
	}
	var (
		state, fence int64
		token        string
	)
	if err := r.Columns(&state, &fence, &token); err != nil {
		return err
	}
	if state == stateDone && fence == c.Fence && token == c.Token {
		return errLanded
	}
	return errFenced
}

// settle decides the outcome of a CompleteTx whose Commit failed with
// cause: it releases c, which fences out that commit if it has not landed
// yet, then reads c's row with a strong read.
func (b *Backend) settle(ctx context.Context, c store.Claim, cause error) (bool, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	unknown := func(err error) (bool, error) {
		return false, fmt.Errorf("spannerlock: complete %q fence %d in a transaction: the commit failed (%w) and settling its outcome failed: %w: %w",
			c.Key, c.Fence, cause, store.ErrCommitUnknown, err)
	}
	if err := b.Release(ctx, c); err != nil {
		return unknown(err)
	}
	r, err := b.client.Single().ReadRow(ctx, b.table, spanner.Key{[]byte(c.Key)}, []string{"state", "fence", "token"})
	if err != nil && spanner.ErrCode(err) != codes.NotFound {
		return unknown(err)
	}
	if err == nil {
		var (
			state, fence int64
			token        string
		)
		if err := r.Columns(&state, &fence, &token); err != nil {
			return unknown(err)
		}
		if state == stateDone && fence == c.Fence && token == c.Token {
			return true, nil
		}
	}
	return false, fmt.Errorf("spannerlock: complete %q fence %d in a transaction: the commit failed and did not land (the claim is released): %w", c.Key, c.Fence, cause)
}
