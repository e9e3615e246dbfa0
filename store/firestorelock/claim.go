package firestorelock

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// maxRounds bounds how often Claim re-reads after losing a race.
const maxRounds = 32

// Claim implements store.Backend: a create (precondition exists=false) for
// a fresh key (1 RPC), else a read and, to reclaim, a write preconditioned
// on the update time the read saw (2 or 3 RPCs). Without a recent server
// timestamp it reads before it creates.
//
// A retry that cannot tell whether a write of this call whose reply was
// lost had won returns an error, not HeldByOther or AlreadyDone: that is
// when the record is found in other hands at or after the lease that write
// would have stored (before it, nobody could have taken the key from it).
func (b *Backend) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Result{}, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return store.Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return store.Result{}, fmt.Errorf("firestorelock: claim %q: %w", key, err)
	}
	lease = wholeMicros(lease)
	token := store.NewToken()
	// pending is the latest lease that a write of this call whose reply
	// was lost may have stored; lost is that write's error.
	var (
		pending time.Time
		lost    error
	)
	_, _, tryInsert := b.times()
	var absent *reading // the read of this call that found no record
	for range maxRounds {
		if tryInsert {
			// Base the lease on the read that found the key absent, or
			// else on the estimate of the server's time.
			_, hi, ok := b.times()
			estimated := true
			if absent != nil {
				hi, ok = b.after(*absent)
				estimated = !absent.exact
			}
			if ok {
				rec := record{state: stateClaimed, fence: 1, lease: hi.Add(lease), token: token}
				rec.exp = rec.lease.Add(b.ttl)
				v, _, at, lostNow, err := b.write(ctx, create(b.document(key, rec)))
				if lostNow != nil {
					pending, lost = later(pending, rec.lease), lostNow
				}
				if err == nil {
					if b.expired(rec, lost) {
						return store.Result{}, b.expiredErr(key, rec, lost)
					}
					if estimated && misplaced(hi, at) {
						return store.Result{}, b.unknown(key, fmt.Errorf("the claim was written with a lease from %v, "+
							"an estimate of the server's time that ran ahead of the commit at %v", hi, at))
					}
					return won(key, rec, v), nil
				}
				if !errors.Is(err, errAlreadyExists) {
					return store.Result{}, b.unknown(key, err)
				}
			}
		}
		cur, found, rd, err := b.lookup(ctx, key)
		if err != nil {
			return store.Result{}, b.unknown(key, err)
		}
		now := rd.at
		absent = nil
		if !found {
			// Never written, or deleted after it expired. Had a lost write
			// of this call landed, the record would stay until at least its
			// lease + ttl.
			if lost != nil && !now.Before(pending.Add(b.ttl)) {
				return store.Result{}, fmt.Errorf("firestorelock: claim %q: outcome unknown: a write of this call may have won the key "+
					"with a lease to %v, and the record, found gone at %v, could have expired since: %w", key, pending, now, lost)
			}
			tryInsert, absent = true, &rd
			continue
		}
		mine := cur.token == token
		switch {
		case mine && cur.state == stateClaimed && now.Before(cur.exp):
			// An earlier try of this call won; its reply was lost. Its
			// lease may have lapsed while the call retried, as it may
			// while any reply travels: the claim is answered as it was
			// won (a renewal would be a second effect of one call).
			return won(key, cur, cur.version), nil
		case mine:
			// It won, but the record expired while the call retried: it
			// may be deleted at any moment and the fence start again at 1.
			return store.Result{}, b.expiredErr(key, cur, lost)
		case lost != nil && !now.Before(pending):
			return store.Result{}, fmt.Errorf("firestorelock: claim %q: outcome unknown: a write of this call may have won the key "+
				"with a lease to %v, and the record, found in other hands at %v, could have changed hands since: %w",
				key, pending, now, lost)
		case cur.state == stateDone && now.Before(cur.exp):
			return store.Result{Outcome: store.AlreadyDone, Until: cur.exp}, nil
		case cur.state == stateClaimed && now.Before(cur.lease):
			return store.Result{Outcome: store.HeldByOther, Until: cur.lease}, nil
		}
		// Reclaimable: the new lease runs from the read that judged it,
		// carried forward to the update.
		base, ok := b.after(rd)
		if !ok {
			return store.Result{}, b.unknown(key, errNoServerTime)
		}
		next := record{state: stateClaimed, fence: cur.fence + 1, lease: base.Add(lease), token: token}
		next.exp = next.lease.Add(b.ttl)
		v, applied, _, lostNow, err := b.write(ctx, update(b.document(key, next), cur.version))
		if lostNow != nil {
			pending, lost = later(pending, next.lease), lostNow
		}
		if err != nil {
			return store.Result{}, b.unknown(key, err)
		}
		if applied {
			if b.expired(next, lost) {
				return store.Result{}, b.expiredErr(key, next, lost)
			}
			return won(key, next, v), nil
		}
		// Someone wrote or deleted the record since the read (or our own
		// update applied and its reply was lost): look again.
		tryInsert = false
	}
	return store.Result{}, fmt.Errorf("firestorelock: claim %q: still contended after %d rounds", key, maxRounds)
}

// expired reports whether a claim that this call wrote after a lost reply
// (lost is not nil) belongs to a record past its expires-at instant: the
// retries outlasted lease and ttl, and the record may have been purged and
// written again by a retried create. It may be deleted at any moment, and
// the next claim would start again at fence 1: the call must not hand it
// out.
func (b *Backend) expired(r record, lost error) bool {
	if lost == nil {
		return false
	}
	lo, _, ok := b.times()
	return !ok || !lo.Before(r.exp)
}

func (b *Backend) expiredErr(key string, r record, lost error) error {
	if lost == nil {
		lost = errors.New("reply lost")
	}
	return fmt.Errorf("firestorelock: claim %q: this call won fence %d, but a reply was lost and the record expired at %v "+
		"before the call could answer (the key is free to claim): %w", key, r.fence, r.exp, lost)
}

func won(key string, r record, version time.Time) store.Result {
	return store.Result{Outcome: store.Won, Claim: store.Claim{
		Key: key, Fence: r.fence, Token: r.token, LeaseExpiry: r.lease, Rev: rev(version),
	}}
}

func (b *Backend) unknown(key string, err error) error {
	return fmt.Errorf("firestorelock: claim %q (outcome unknown: the key may be held until its lease lapses): %w", key, err)
}
