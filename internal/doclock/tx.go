package doclock

import (
	"context"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// TxBasis is what a completion inside a transaction (a backend's
// CompleteTx) writes its Done record from. The transaction itself cannot
// tell the server's time (its commit time is known only after it), so the
// instants follow the rules of the other writes: with a fresh estimate of
// the server's time and a claim that carries the record's version, Now is
// the estimate's upper bound and Cur is the record as the claim left it
// (no request); otherwise TxBase reads the record, and Now is that read's
// read_time carried forward (see Clock.after), Cur the record it read.
type TxBasis struct {
	Cur  Record
	Now  time.Time
	Held bool // Cur is Claimed with the claim's fence and token
}

// TxBase returns the base of a transactional completion of claim c (see
// [TxBasis]). Held is false when a read found the record gone, or not
// Claimed by c.
func (l *Lock) TxBase(ctx context.Context, c store.Claim) (TxBasis, error) {
	if now, fresh := l.clock.estimate(); fresh && c.Rev != 0 {
		return TxBasis{Cur: fromClaim(c, l.ttl), Now: now, Held: true}, nil
	}
	r, found, rd, err := l.st.Read(ctx, c.Key)
	if err != nil {
		return TxBasis{}, err
	}
	now, ok := l.clock.after(rd)
	if !ok {
		return TxBasis{}, ErrNoServerTime
	}
	return TxBasis{Cur: r, Now: now, Held: found && holds(r, c) && r.State == StateClaimed}, nil
}
