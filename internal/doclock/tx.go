package doclock

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// TxDone returns the Done record that a completion of claim c inside a
// transaction (a backend's CompleteTx) writes with fingerprint fp, from
// cur, the record as the transaction itself read it after the body (found
// is false when there was none). held is false when cur is not Claimed
// with c's fence and token: the transaction must not mark it.
//
// The record keeps cur's fence, token and lease (a renewal's included);
// it expires a ttl after the server's time, which follows the rules of the
// other writes, as the transaction cannot tell it (its commit time is
// known only after it): the estimate's upper bound when it is fresh; else
// the read_time of rd (the transaction's read, when the service stamped
// it) carried forward; else that of a read of the record outside the
// transaction.
func (l *Lock) TxDone(ctx context.Context, c store.Claim, fp string, cur Record, found bool, rd *Reading) (next Record, held bool, err error) {
	if !found || !holds(cur, c) || cur.State != StateClaimed {
		return cur, false, nil
	}
	now, ok := l.clock.estimate()
	if !ok && rd != nil && rd.Exact {
		now, ok = l.clock.after(*rd)
	}
	if !ok {
		_, _, out, err := l.st.Read(ctx, c.Key)
		if err != nil {
			return cur, false, fmt.Errorf("server time: %w", err)
		}
		if now, ok = l.clock.after(out); !ok {
			return cur, false, fmt.Errorf("server time: %w", ErrNoServerTime)
		}
	}
	next = cur
	next.State, next.Exp, next.Fingerprint = StateDone, instant(now, l.ttl), fp
	return next, true, nil
}

// TxLanded reports whether cur, the record as a transaction read it
// (found is false when there was none), is the Done record of one of sent,
// the Done records that earlier attempts of the same completion committed
// with (all but the version alike): such an attempt's commit applied,
// though its reply said otherwise (a resent commit refused as aborted),
// and the completion has committed; the attempt that reads it must not
// commit again, nor report the claim as gone.
func TxLanded(cur Record, found bool, sent []Record) bool {
	return found && cur.State == StateDone && slices.ContainsFunc(sent, func(s Record) bool { return sameRecord(s, cur) })
}

// Committing keeps the renewals ([Lock.Extend]) of claim c away from its
// completion inside a transaction: it waits until no renewal of c (same
// key, fence and token) is in flight, and until the returned end is
// called no renewal of c starts (they wait for it). A backend's CompleteTx
// holds it from its read of the record in the transaction, after the body,
// until the commit has answered: a renewal that wrote the record in
// between would abort the transaction (Datastore) or wait on its lock
// (Firestore), and an aborted transaction runs the body again, which a
// heartbeat's own renewals must not cause. Renewals of c while the body
// runs are not held back; the transaction does not read the record then.
//
// It returns an error wrapping ctx's when ctx ends before the renewals in
// flight do.
func (l *Lock) Committing(ctx context.Context, c store.Claim) (end func(), err error) {
	return l.gates.enter(ctx, gateOf(c))
}

// gateKey names a claim: renewals and the transactional completion of
// the same claim take turns.
type gateKey struct {
	key, token string
	fence      int64
}

func gateOf(c store.Claim) gateKey { return gateKey{key: c.Key, token: c.Token, fence: c.Fence} }

// gates lets one party at a time work on a claim's record: a renewal, or a
// transactional completion between its read and its commit. The zero
// value is ready to use.
type gates struct {
	mu sync.Mutex
	m  map[gateKey]*gate
}

// gate is one claim's turn: a channel of one slot, and the number of
// parties that hold it or wait for it (the entry is dropped at zero).
type gate struct {
	slot  chan struct{}
	users int
}

// enter waits for k's turn (or ctx's end) and returns the function that
// ends it.
func (g *gates) enter(ctx context.Context, k gateKey) (func(), error) {
	g.mu.Lock()
	if g.m == nil {
		g.m = map[gateKey]*gate{}
	}
	e := g.m[k]
	if e == nil {
		e = &gate{slot: make(chan struct{}, 1)}
		g.m[k] = e
	}
	e.users++
	g.mu.Unlock()
	leave := func() {
		g.mu.Lock()
		if e.users--; e.users == 0 {
			delete(g.m, k)
		}
		g.mu.Unlock()
	}
	select {
	case e.slot <- struct{}{}:
	case <-ctx.Done():
		leave()
		return nil, fmt.Errorf("waiting for the claim's renewal or commit in flight: %w", ctx.Err())
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			<-e.slot
			leave()
		})
	}, nil
}

// TxCalls is what a backend's connection sees of the calls that a client
// library (cloud.google.com/go/datastore or firestore) sends for one
// CompleteTx, whose context carries it ([WithTxCalls]): the transaction
// the library began last (the ID of its BeginTransaction reply), which the
// backend rolls back itself when the library cannot (a panicking body, an
// ended context), and how many Commit calls it sent (the backend resets
// the count for each attempt).
type TxCalls struct {
	Commits atomic.Int32
	mu      sync.Mutex
	id      []byte
}

// Began records the ID of a transaction that a BeginTransaction reply
// carried.
func (c *TxCalls) Began(id []byte) {
	c.mu.Lock()
	c.id = id
	c.mu.Unlock()
}

// Tx returns the ID of the transaction that began last (nil when none).
func (c *TxCalls) Tx() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.id
}

// RollbackTimeout bounds a rollback that [TxCalls.RollBack] sends.
const RollbackTimeout = 5 * time.Second

// RollBack ends the transaction that began last (none: nothing to do) by
// calling send with its ID, on a context of its own (ctx's values, not its
// end, bounded by RollbackTimeout): the caller's context may have ended,
// or its body panicked, and the transaction must not stay open, with what
// it read locked, until it expires. A failure is ignored: the service then
// ends the transaction when it expires.
func (c *TxCalls) RollBack(ctx context.Context, send func(ctx context.Context, tx []byte) error) {
	tx := c.Tx()
	if tx == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), RollbackTimeout)
	defer cancel()
	_ = send(ctx, tx)
}

type txCallsKey struct{}

// WithTxCalls returns ctx carrying a new TxCalls, and that TxCalls.
func WithTxCalls(ctx context.Context) (context.Context, *TxCalls) {
	c := &TxCalls{}
	return context.WithValue(ctx, txCallsKey{}, c), c
}

// TxCallsOf returns the TxCalls that ctx carries (nil when none).
func TxCallsOf(ctx context.Context) *TxCalls {
	c, _ := ctx.Value(txCallsKey{}).(*TxCalls)
	return c
}
