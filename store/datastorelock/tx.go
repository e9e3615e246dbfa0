package datastorelock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"cloud.google.com/go/datastore"
	pb "cloud.google.com/go/datastore/apiv1/datastorepb"
	gtransport "google.golang.org/api/transport/grpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/retry"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var _ store.TxBackend[*datastore.Transaction] = (*Backend)(nil)

// txAttempts is how many transactions CompleteTx begins at most when the
// store aborts them (the default of datastore.RunInTransaction is 3).
const txAttempts = 5

// settleTimeout bounds the settling of a commit whose reply was lost.
const settleTimeout = 30 * time.Second

// CompleteTx implements store.TxCompleter: it completes claim c in a
// read-write transaction of the backend's own database (its connection,
// project and database, through a cloud.google.com/go/datastore client it
// builds on them), together with whatever body writes in it.
//
// It begins the transaction (NewTransaction, never BeginLater), calls body
// with it, and only then reads c's record in the transaction. If the
// record is Claimed with c's fence and token, it puts the Done record,
// exactly as CompleteFingerprint writes it (fingerprint fp, none when
// empty), and commits once: body's mutations and the Done record land
// together or not at all. Otherwise it rolls back and returns false, nil.
// The record is read after body returns, so the transaction does not hold
// it while body runs: a concurrent Claim of the key gets HeldByOther at
// once (on Firestore in Datastore mode, whose transactions lock what they
// read, the lock lasts from that read to the commit). Renewals of c
// through this Backend (Extend, as WithHeartbeat sends them) wait from
// that read to the commit's answer: a renewal that wrote the record in
// between would abort the transaction and run body again. Renewals while
// body runs change nothing that the transaction read.
//
// The Done record (its lease as the last renewal left it) expires a ttl
// after the server's time as every other write of the backend bases it
// (see Clock in the package doc): the estimate's upper bound when it is
// fresh, else the read_time of a read of the record (outside the
// transaction) carried forward. The transaction's commit time is not
// known before it commits.
//
// When body returns an error it rolls back and returns an error wrapping
// it; when body panics, it rolls back, and the panic goes on. When body (or a read in the transaction, or the commit) fails with
// datastore.ErrConcurrentTransaction or Aborted, the transaction is rolled
// back and a fresh one begun, calling body again (at most 5 transactions
// in all): only the writes of the transaction that commits exist, and
// whatever body does outside the transaction happens once per call. A
// transaction that finds the record Done exactly as an earlier one's
// commit wrote it (a commit that applied but was answered Aborted) rolls
// back and returns true, nil.
//
// When the commit fails in a way that leaves open whether it applied (its
// reply was lost, the connection dropped, ctx ended while it was in
// flight), CompleteTx settles it before it returns, on a context of its
// own (30s, not cancelled with ctx): it releases c (the fence moves on, so
// a commit still in flight can no longer apply: it read the record, which
// the release changes) and reads the record. Done with c's fence and token
// returns true, nil; anything else returns an error (nothing committed,
// and the key is free to claim again). When that settling fails, the
// error wraps store.ErrCommitUnknown.
//
// Limits are Datastore's: a transaction carries at most 10 MiB, lasts at
// most 270 seconds (60 seconds idle), and on a Cloud Datastore database
// not yet upgraded to Firestore in Datastore mode touches at most 25
// entity groups (the record's is one); body's entities must live in the
// backend's database (WithDatabase), in any namespace and kind.
func (b *Backend) CompleteTx(ctx context.Context, c store.Claim, fp string, body func(ctx context.Context, tx *datastore.Transaction) error) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	if err := store.ValidateFingerprint(fp); err != nil {
		return false, err
	}
	if body == nil {
		return false, fmt.Errorf("datastorelock: complete %q fence %d in a transaction: nil body", c.Key, c.Fence)
	}
	client, err := b.txClient()
	if err != nil {
		return false, err
	}
	wait := retry.Policy{Base: retryBase, Max: retryMax}
	var sent []doclock.Record // the Done records of the attempts' commits
	for attempt := 0; ; attempt++ {
		done, err := b.completeTx(ctx, client, c, fp, body, &sent)
		if !errors.Is(err, errAborted) || attempt+1 == txAttempts {
			return done, err
		}
		if werr := wait.Wait(ctx, attempt); werr != nil {
			return false, fmt.Errorf("%w (then: %w)", err, werr)
		}
	}
}

// errAborted marks an attempt of CompleteTx that the store aborted: it
// applied nothing, and a fresh transaction may follow.
var errAborted = errors.New("the transaction was aborted")

// aborted reports whether err is Datastore's report of an aborted
// transaction.
func aborted(err error) bool {
	return errors.Is(err, datastore.ErrConcurrentTransaction) || status.Code(err) == codes.Aborted
}

// completeTx is one transaction of CompleteTx. An error wrapping
// errAborted means that it applied nothing (so far as the store said) and
// may be tried again. sent holds the Done records of the commits of the
// attempts before, to which it adds its own: one found in the record
// applied, though the store answered it Aborted.
func (b *Backend) completeTx(ctx context.Context, client *datastore.Client, c store.Claim, fp string, body func(context.Context, *datastore.Transaction) error,
	sent *[]doclock.Record) (bool, error) {
	fail := func(what string, err error) error {
		if aborted(err) {
			return fmt.Errorf("datastorelock: complete %q fence %d in a transaction: %s: %w: %w", c.Key, c.Fence, what, errAborted, err)
		}
		return fmt.Errorf("datastorelock: complete %q fence %d in a transaction: %s: %w", c.Key, c.Fence, what, err)
	}
	ctx, calls := doclock.WithTxCalls(ctx)
	tx, err := client.NewTransaction(ctx)
	if err != nil {
		return false, fail("begin", err)
	}
	finished := false // committed or rolled back
	defer func() {
		if !finished {
			// Not tx.Rollback, which runs on ctx: body may have returned
			// because ctx ended (or panicked), and the transaction would
			// stay open, with whatever it read locked on Firestore in
			// Datastore mode, until it expires.
			calls.RollBack(ctx, b.rollback)
		}
	}()
	if err := body(ctx, tx); err != nil {
		return false, fail("body", err)
	}
	// From the read of the record to the commit's answer, renewals of c
	// wait: one that wrote the record in between would abort the
	// transaction, and the body would run again.
	end, err := b.lk.Committing(ctx, c)
	if err != nil {
		return false, fail("read the record", err)
	}
	defer end()
	k := datastore.NameKey(b.kind, Name(c.Key), nil)
	k.Namespace = b.namespace
	var (
		props datastore.PropertyList
		cur   doclock.Record
		found = true
	)
	switch err := tx.Get(k, &props); {
	case errors.Is(err, datastore.ErrNoSuchEntity):
		found = false
	case err != nil:
		return false, fail("read the record", err)
	default:
		if cur, err = decodeProps(props); err != nil {
			return false, fail("read the record", err)
		}
	}
	if doclock.TxLanded(cur, found, *sent) {
		return true, nil // rolled back: an earlier attempt's commit applied
	}
	next, held, err := b.lk.TxDone(ctx, c, fp, cur, found, nil)
	if err != nil {
		return false, fail("the done record", err)
	}
	if !held {
		return false, nil
	}
	props = recordProps(next)
	if _, err := tx.Put(k, &props); err != nil {
		return false, fail("put the record", err)
	}
	*sent = append(*sent, next)
	_, err = tx.Commit()
	end()
	if err == nil {
		finished = true
		return true, nil
	}
	if aborted(err) {
		return false, fail("commit", err)
	}
	calls.RollBack(ctx, b.rollback) // a commit still in flight is aborted by it, or by the release
	finished = true
	return b.settle(ctx, c, err)
}

// rollback sends a Rollback of transaction tx.
func (b *Backend) rollback(ctx context.Context, tx []byte) error {
	_, err := b.rpc.Rollback(b.ctx(ctx), &pb.RollbackRequest{ProjectId: b.project, DatabaseId: b.database, Transaction: tx})
	return err
}

// settle decides a commit of CompleteTx that failed with commitErr, which
// leaves open whether it applied: it releases c, which fences out a commit
// still in flight, and reads the record.
func (b *Backend) settle(ctx context.Context, c store.Claim, commitErr error) (bool, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	if err := b.lk.Release(ctx, c); err != nil {
		return false, fmt.Errorf("datastorelock: complete %q fence %d in a transaction: the commit failed (%w), and releasing the claim "+
			"to settle it failed: %w: %w", c.Key, c.Fence, commitErr, store.ErrCommitUnknown, err)
	}
	r, found, _, err := requests{b}.Read(ctx, c.Key)
	if err != nil {
		return false, fmt.Errorf("datastorelock: complete %q fence %d in a transaction: the commit failed (%w), and reading the record "+
			"to settle it failed: %w: %w", c.Key, c.Fence, commitErr, store.ErrCommitUnknown, err)
	}
	if found && r.State == doclock.StateDone && r.Fence == c.Fence && r.Token == c.Token {
		return true, nil
	}
	return false, fmt.Errorf("datastorelock: complete %q fence %d in a transaction: the commit failed and did not apply "+
		"(the claim is released): %w", c.Key, c.Fence, commitErr)
}

// recordProps encodes r as entity() does, for the datastore client.
func recordProps(r doclock.Record) datastore.PropertyList {
	p := datastore.PropertyList{
		{Name: propState, Value: r.State, NoIndex: true},
		{Name: propFence, Value: r.Fence, NoIndex: true},
		{Name: propLease, Value: r.Lease, NoIndex: true},
		{Name: propExpiresAt, Value: r.Exp},
		{Name: propToken, Value: r.Token, NoIndex: true},
	}
	if r.Fingerprint != "" {
		p = append(p, datastore.Property{Name: propFP, Value: r.Fingerprint, NoIndex: true})
	}
	return p
}

// decodeProps decodes a record as decode does, from the datastore client.
func decodeProps(p datastore.PropertyList) (doclock.Record, error) {
	var r doclock.Record
	for _, q := range p {
		switch v := q.Value.(type) {
		case int64:
			switch q.Name {
			case propState:
				r.State = v
			case propFence:
				r.Fence = v
			}
		case time.Time:
			switch q.Name {
			case propLease:
				r.Lease = v
			case propExpiresAt:
				r.Exp = v
			}
		case string:
			switch q.Name {
			case propToken:
				r.Token = v
			case propFP:
				r.Fingerprint = v
			}
		}
	}
	if (r.State != doclock.StateClaimed && r.State != doclock.StateDone) || r.Fence < 1 {
		return r, fmt.Errorf("the entity is not a record of this backend (state %d, fence %d)", r.State, r.Fence)
	}
	return r, nil
}

// txClient returns the datastore client of CompleteTx, built on first use
// on the Backend's connection (which its Close never closes: the Backend's
// owner, or the Backend, does).
func (b *Backend) txClient() (*datastore.Client, error) {
	b.tx.once.Do(func() {
		b.tx.client, b.tx.err = datastore.NewClientWithDatabase(context.Background(), b.project, b.database,
			gtransport.WithConnPool(sharedConn{b.conn}))
		if b.tx.err != nil {
			b.tx.err = fmt.Errorf("datastorelock: a datastore client on the backend's connection: %w", b.tx.err)
		}
	})
	return b.tx.client, b.tx.err
}

// txClient is the datastore client that CompleteTx builds once.
type txClient struct {
	once   sync.Once
	client *datastore.Client
	err    error
}

// sharedConn lends the Backend's connection to the datastore client as a
// pool of one that its Close leaves open (WithConnPool, which the Google
// client libraries use to share a pool, takes any
// grpc.ClientConnInterface, as New does).
type sharedConn struct{ grpc.ClientConnInterface }

// Conn returns the connection when it is a *grpc.ClientConn (the datastore
// client does not ask).
func (s sharedConn) Conn() *grpc.ClientConn {
	cc, _ := s.ClientConnInterface.(*grpc.ClientConn)
	return cc
}

func (sharedConn) Num() int     { return 1 }
func (sharedConn) Close() error { return nil }

// Invoke records the transaction of a BeginTransaction reply on a context
// that CompleteTx marked (doclock.TxCalls).
func (s sharedConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	err := s.ClientConnInterface.Invoke(ctx, method, args, reply, opts...)
	if res, ok := reply.(*pb.BeginTransactionResponse); ok && err == nil {
		if calls := doclock.TxCallsOf(ctx); calls != nil {
			calls.Began(res.GetTransaction())
		}
	}
	return err
}
