package firestorelock

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"cloud.google.com/go/firestore"
	pb "cloud.google.com/go/firestore/apiv1/firestorepb"
	"google.golang.org/api/option"
	gtransport "google.golang.org/api/transport/grpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var _ store.TxBackend[*firestore.Transaction] = (*Backend)(nil)

// settleTimeout bounds the settling of a commit whose reply was lost.
const settleTimeout = 30 * time.Second

// staleRounds bounds how often CompleteTx runs the transaction again
// because the commit's precondition failed on a record that the claim
// still holds, changed since the transaction read it (which the read's
// lock rules out, unless a renewal through another Backend wrote it
// anyway).
const staleRounds = 3

// CompleteTx implements store.TxCompleter: it completes claim c in a
// read-write transaction of the backend's own database (its connection,
// project and database, through a cloud.google.com/go/firestore client it
// builds on them), together with whatever body writes in it.
//
// It runs the transaction with the client's RunTransaction: body is called
// with it, and then the transaction reads c's record (a read in the
// transaction, sent on the Backend's connection, as the client refuses
// reads after body's writes). If the record is Claimed with c's fence and
// token, the Done record, exactly as CompleteFingerprint writes it
// (fingerprint fp, none when empty; the lease as the last renewal left
// it), is added to its writes with the precondition that the record's
// update time is still the one that read saw. The transaction commits
// once: body's writes and the Done record land together or not at all.
// When c no longer holds the record (it was replaced, released or
// completed), nothing commits and CompleteTx returns false, nil. The
// record is read only after body returns, so nothing of it is locked
// while body runs: a concurrent Claim of the key gets HeldByOther at once;
// the read's lock lasts until the commit. Renewals of c through this
// Backend (Extend, as WithHeartbeat sends them) wait from that read to
// the commit's answer, so that the heartbeat's own renewals never make
// the transaction run body again; renewals while body runs change nothing
// that the transaction read.
//
// The Done record expires a ttl after the server's time as every other
// write of the backend bases it (see Clock in the package doc): the
// estimate's upper bound when it is fresh, else the read_time of the
// transaction's read carried forward. The transaction's commit time is not
// known before it commits; it refreshes the estimate afterwards.
//
// When body returns an error, it rolls back and returns an error wrapping
// it. When body panics (or calls runtime.Goexit), it rolls the transaction
// back on a context of its own (5s, not cancelled with ctx), so that
// nothing body read stays locked, and the panic goes on with body's value.
// When Firestore aborts the transaction (a contended read of body's:
// Aborted, from body or from the commit), the client rolls back and runs
// it again with a fresh transaction, calling body again (at most 5
// transactions): only the writes of the transaction that commits exist,
// and whatever body does outside the transaction happens once per call. A
// transaction that finds the record Done exactly as an earlier one's
// commit wrote it (a commit that applied but was answered Aborted) rolls
// back and returns true, nil.
//
// When the commit fails in a way that leaves open whether it applied (its
// reply was lost, the connection dropped, ctx ended while it was in
// flight), CompleteTx settles it before it returns, on a context of its
// own (30s, not cancelled with ctx): it releases c (the record's update
// time moves on, so a commit still in flight fails its precondition) and
// reads the record. Done with c's fence and token returns true, nil;
// anything else returns an error (nothing committed, and the key is free
// to claim again). When that settling fails, the error wraps
// store.ErrCommitUnknown.
//
// Limits are Firestore's: a transaction lasts at most 270 seconds (60
// seconds idle) and a commit carries at most 10 MiB; body's documents must
// live in the backend's database (WithDatabase), in any collection.
//
// The client is built on the Backend's connection. When
// FIRESTORE_EMULATOR_HOST is set, the firestore client also dials the
// emulator on its own; that connection stays idle.
func (b *Backend) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(ctx context.Context, tx *firestore.Transaction) error) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	if err := store.ValidateFingerprint(fp); err != nil {
		return false, err
	}
	if body == nil {
		return false, fmt.Errorf("firestorelock: complete %q fence %d in a transaction: nil body", c.Key, c.Fence)
	}
	client, err := b.txClient()
	if err != nil {
		return false, err
	}
	for round := 0; ; round++ {
		done, stale, err := b.completeTx(ctx, client, c, fp, body)
		if !stale || round+1 == staleRounds {
			return done, err
		}
	}
}

// errFenced ends a transaction of CompleteTx whose claim no longer holds
// the record; errLanded one that found the record Done by the commit of an
// earlier attempt (answered Aborted, though it applied).
var (
	errFenced = errors.New("the claim no longer holds the record")
	errLanded = errors.New("an earlier attempt's commit applied")
)

// completeTx is one RunTransaction of CompleteTx. stale reports a
// precondition that failed on a record that c still holds, changed: run it
// again on the record as it is.
func (b *Backend) completeTx(ctx context.Context, client *firestore.Client, c store.Claim, fp string, body func(context.Context, *firestore.Transaction) error) (done, stale bool, err error) {
	doc := client.Collection(b.collection).Doc(Name(c.Key))
	ctx, calls := doclock.WithTxCalls(ctx)
	var (
		committing bool             // the last attempt's body returned, and its commit was sent
		sent       []doclock.Record // the Done records of the attempts' commits
		next       doclock.Record
		at         time.Time // when the last commit was sent
		cr         firestore.CommitResponse
		end        func() // ends the commit's turn on c (Committing)
	)
	endTurn := func() {
		if end != nil {
			end()
			end = nil
		}
	}
	defer endTurn()
	err = client.RunTransaction(ctx, func(ctx context.Context, tx *firestore.Transaction) (err error) {
		endTurn() // an earlier attempt's, whose commit was aborted
		committing = false
		calls.Commits.Store(0)
		returned := false
		defer func() {
			if !returned {
				// body panicked (or called runtime.Goexit): the client
				// never rolls back, and the transaction would keep
				// what it read locked until the server expires it.
				calls.RollBack(ctx, b.rollback)
			}
		}()
		err = body(ctx, tx)
		returned = true
		if err != nil {
			return err
		}
		// From the read of the record to the commit's answer, renewals of
		// c wait: they would wait on the read's lock, or abort the
		// transaction, which would run the body again.
		if end, err = b.lk.Committing(ctx, c); err != nil {
			return fmt.Errorf("read the record: %w", err)
		}
		// Read in the transaction, with the client's own read refused
		// after body's writes: the record is locked from here to the
		// commit, never while body runs.
		cur, found, rd, err := b.lookup(ctx, b.docName(c.Key), calls.Tx())
		if err != nil {
			return fmt.Errorf("read the record: %w", err)
		}
		if doclock.TxLanded(cur, found, sent) {
			return errLanded
		}
		var held bool
		if next, held, err = b.lk.TxDone(ctx, c, fp, cur, found, &rd); err != nil {
			return err
		}
		if !held {
			return errFenced
		}
		var fpv any = firestore.Delete
		if fp != "" {
			fpv = fp
		}
		if err := tx.Update(doc, []firestore.Update{
			{Path: fieldState, Value: next.State},
			{Path: fieldFence, Value: next.Fence},
			{Path: fieldLease, Value: next.Lease},
			{Path: fieldExpiresAt, Value: next.Exp},
			{Path: fieldToken, Value: next.Token},
			{Path: fieldFP, Value: fpv},
		}, firestore.LastUpdateTime(unrev(cur.Version))); err != nil {
			return err
		}
		committing, at, sent = true, b.now(), append(sent, next)
		return nil
	}, firestore.WithCommitResponseTo(&cr))
	endTurn()
	switch {
	case err == nil:
		if ct := cr.CommitTime(); ct.After(time.Unix(0, 0)) {
			b.clock.Observe(ct, at, b.now(), false)
		}
		return true, false, nil
	case errors.Is(err, errLanded):
		return true, false, nil
	case errors.Is(err, errFenced):
		return false, false, nil
	case !committing:
		return false, false, fmt.Errorf("firestorelock: complete %q fence %d in a transaction: %w", c.Key, c.Fence, err)
	case status.Code(err) == codes.Aborted:
		// Aborted at every attempt: none applied.
		return false, false, fmt.Errorf("firestorelock: complete %q fence %d in a transaction: commit: %w", c.Key, c.Fence, err)
	case status.Code(err) == codes.FailedPrecondition || status.Code(err) == codes.NotFound:
		return b.refused(ctx, c, next, calls.Commits.Load() > 1, err)
	}
	done, err = b.settle(ctx, c, err)
	return done, false, err
}

// rollback sends a Rollback of transaction tx.
func (b *Backend) rollback(ctx context.Context, tx []byte) error {
	_, err := b.rpc.Rollback(b.ctx(ctx), &pb.RollbackRequest{Database: b.db, Transaction: tx})
	return err
}

// refused decides a commit whose precondition failed: the record is no
// longer the one the transaction based its write on. When the client
// resent the commit (resent), the first send may have applied with its
// reply lost: the record is then the Done record next itself (true). A record that c still holds, changed, is run
// again (stale). Otherwise c no longer holds it (false).
func (b *Backend) refused(ctx context.Context, c store.Claim, next doclock.Record, resent bool, commitErr error) (done, stale bool, err error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	r, found, _, err := requests{b}.Read(ctx, c.Key)
	switch {
	case err != nil:
		return false, false, fmt.Errorf("firestorelock: complete %q fence %d in a transaction: the commit's precondition failed (%w), "+
			"and reading the record to tell why failed: %w: %w", c.Key, c.Fence, commitErr, store.ErrCommitUnknown, err)
	case !found || r.Fence != c.Fence || r.Token != c.Token:
		return false, false, nil
	case r.State == doclock.StateClaimed:
		return false, true, fmt.Errorf("firestorelock: complete %q fence %d in a transaction: the record changed under the claim: %w",
			c.Key, c.Fence, commitErr)
	case resent && r.Lease.Equal(next.Lease) && r.Exp.Equal(next.Exp) && r.Fingerprint == next.Fingerprint:
		return true, false, nil
	}
	return false, false, nil // completed by another call of the same claim
}

// settle decides a commit of CompleteTx that failed with commitErr, which
// leaves open whether it applied: it releases c, which fences out a commit
// still in flight, and reads the record.
func (b *Backend) settle(ctx context.Context, c store.Claim, commitErr error) (bool, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	if err := b.lk.Release(ctx, c); err != nil {
		return false, fmt.Errorf("firestorelock: complete %q fence %d in a transaction: the commit failed (%w), and releasing the claim "+
			"to settle it failed: %w: %w", c.Key, c.Fence, commitErr, store.ErrCommitUnknown, err)
	}
	r, found, _, err := requests{b}.Read(ctx, c.Key)
	if err != nil {
		return false, fmt.Errorf("firestorelock: complete %q fence %d in a transaction: the commit failed (%w), and reading the record "+
			"to settle it failed: %w: %w", c.Key, c.Fence, commitErr, store.ErrCommitUnknown, err)
	}
	if found && r.State == doclock.StateDone && r.Fence == c.Fence && r.Token == c.Token {
		return true, nil
	}
	return false, fmt.Errorf("firestorelock: complete %q fence %d in a transaction: the commit failed and did not apply "+
		"(the claim is released): %w", c.Key, c.Fence, commitErr)
}

// txClient is the firestore client that CompleteTx builds once.
type txClient struct {
	once   sync.Once
	client *firestore.Client
	err    error
}

// txClient returns the firestore client of CompleteTx, built on first use
// on the Backend's connection. The Backend never closes it: closing it
// would close the connection, which the Backend's owner (or the Backend)
// closes.
func (b *Backend) txClient() (*firestore.Client, error) {
	b.tx.once.Do(func() {
		b.tx.client, b.tx.err = firestore.NewClientWithDatabase(context.Background(), b.project, b.database, b.connOption()...)
		if b.tx.err != nil {
			b.tx.err = fmt.Errorf("firestorelock: a firestore client on the backend's connection: %w", b.tx.err)
		}
	})
	return b.tx.client, b.tx.err
}

// connOption hands the Backend's connection to the firestore client as a
// pool of one (WithConnPool, which the Google client libraries use to
// share a pool), so that sharedConn sees the transaction's Commit calls.
// WithGRPCConn(nil) first undoes the connection the client dials itself
// when FIRESTORE_EMULATOR_HOST is set, which it would refuse beside a
// pool (that connection stays idle).
func (b *Backend) connOption() []option.ClientOption {
	return []option.ClientOption{option.WithGRPCConn(nil), gtransport.WithConnPool(sharedConn{b.conn})}
}

// sharedConn lends the Backend's connection to the firestore client as a
// pool of one that its Close leaves open.
type sharedConn struct{ grpc.ClientConnInterface }

// Conn returns the connection when it is a *grpc.ClientConn.
func (s sharedConn) Conn() *grpc.ClientConn {
	cc, _ := s.ClientConnInterface.(*grpc.ClientConn)
	return cc
}

func (sharedConn) Num() int { return 1 }

// Invoke counts a Commit, and records the transaction of a
// BeginTransaction reply, on a context that CompleteTx marked
// (doclock.TxCalls): more than one Commit for an attempt means that the
// client sent it again (it does after Unavailable), so a refused
// precondition may be the refusal of a resend whose first send applied.
func (s sharedConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	calls := doclock.TxCallsOf(ctx)
	if calls != nil && strings.HasSuffix(method, "/Commit") {
		calls.Commits.Add(1)
	}
	err := s.ClientConnInterface.Invoke(ctx, method, args, reply, opts...)
	if res, ok := reply.(*pb.BeginTransactionResponse); ok && calls != nil && err == nil {
		calls.Began(res.GetTransaction())
	}
	return err
}
func (sharedConn) Close() error { return nil }
