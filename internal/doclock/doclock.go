// Package doclock is the lock that datastorelock and firestorelock share:
// records of one document (or entity) per key, written outside
// transactions with preconditions on the record's version, leases and ttls
// judged by the service's clock ([Clock]), and lost replies recognised by
// the claim token. A backend supplies the three requests of its API as a
// [Store]; this package decides what to read and write.
package doclock

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The states of a record.
const (
	StateClaimed = 1
	StateDone    = 2
)

// Record is a decoded record. Version is the service's version of it (as
// store.Claim.Rev carries it; 0 when unknown).
type Record struct {
	State       int64
	Fence       int64
	Lease, Exp  time.Time
	Token       string
	Fingerprint string // the payload fingerprint of a Done record; "" for none
	Version     int64
}

// Store is what a backend does on its service, each call retried as the
// backend's WithRetries says. lost is the error of the latest attempt of a
// write that failed in a way that leaves open whether the service applied
// it: the write may then have applied even when err is set or applied is
// false. at is the commit's server time (zero when the reply carries
// none); the backend has passed it, and every read's time, to the Clock.
type Store interface {
	// Read reads key's record; found is false when there is none.
	Read(ctx context.Context, key string) (r Record, found bool, rd Reading, err error)
	// Create writes r when key has no record, else fails with an error
	// wrapping ErrExists.
	Create(ctx context.Context, key string, r Record) (version int64, at time.Time, lost, err error)
	// Update replaces key's record with r if its version is still base;
	// applied is false when it is not, or the record is gone.
	Update(ctx context.Context, key string, r Record, base int64) (version int64, applied bool, at time.Time, lost, err error)
}

// ErrExists is what Store.Create returns for a key that has a record.
var ErrExists = errors.New("the record exists")

// Lock implements the store.Backend methods on a Store. Build it with
// [New].
type Lock struct {
	name  string // the backend's package, which prefixes its errors
	ttl   time.Duration
	clock *Clock
	st    Store
	gates gates // renewals and transactional completions of a claim take turns
}

// New returns the Lock of backend name (its package name, for errors)
// keeping records a whole-microsecond ttl past their lease, judging time
// by clock, on st.
func New(name string, ttl time.Duration, clock *Clock, st Store) *Lock {
	return &Lock{name: name, ttl: ttl, clock: clock, st: st}
}

// maxRounds bounds how often a call re-reads after losing a race.
const maxRounds = 32

// Claim implements store.Backend.Claim: a create for a fresh key (1
// request), else a read and, to reclaim, an update conditioned on the
// version the read saw (2 or 3 requests). Without a recent server
// timestamp it reads before it creates.
//
// A retry that cannot tell whether a write of this call whose reply was
// lost had won returns an error, not HeldByOther or AlreadyDone: that is
// when the record is found in other hands at or after the lease that write
// would have stored (before it, nobody could have taken the key from it).
func (l *Lock) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Result{}, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return store.Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return store.Result{}, fmt.Errorf("%s: claim %q: %w", l.name, key, err)
	}
	token := store.NewToken()
	start := l.clock.Now() // the call began: no instant it writes may lie before it
	// pending is the latest lease that a write of this call whose reply
	// was lost may have stored; lost is that write's error.
	var (
		pending time.Time
		lost    error
	)
	_, tryCreate := l.clock.estimate()
	var absent *Reading // the read of this call that found no record
	for range maxRounds {
		if tryCreate {
			// Base the lease on the read that found the key absent, or
			// else on the estimate of the server's time.
			hi, ok := l.clock.estimate()
			estimated := true
			if absent != nil {
				hi, ok = l.clock.after(*absent)
				estimated = !absent.Exact
			}
			if ok {
				rec := Record{State: StateClaimed, Fence: 1, Lease: instant(hi, lease), Token: token}
				rec.Exp = instant(rec.Lease, l.ttl)
				v, at, lostNow, err := l.st.Create(ctx, key, rec)
				rtt := l.clock.Now().Sub(start)
				if lostNow != nil {
					pending, lost = later(pending, rec.Lease), lostNow
				}
				if err == nil {
					if l.expired(rec, lost) {
						return store.Result{}, l.expiredErr(key, rec, lost)
					}
					if estimated && ranAhead(hi, at) {
						return store.Result{}, l.unknown(key, fmt.Errorf("the claim was written with a lease from %v, "+
							"an estimate of the server's time that ran ahead of the commit at %v", hi, at))
					}
					if !ranBehind(hi, at, rtt) {
						return won(key, rec, v), nil
					}
					// The lease was written from a time well before the
					// commit: it may have lapsed already. Write it again
					// from the commit's time, or learn who took the key.
					res, done, err := l.rewrite(ctx, key, rec, v, at, lease, &pending, &lost)
					if done || err != nil {
						return res, err
					}
					tryCreate, absent = false, nil
					continue
				}
				if !errors.Is(err, ErrExists) {
					return store.Result{}, l.unknown(key, err)
				}
			}
		}
		cur, found, rd, err := l.st.Read(ctx, key)
		if err != nil {
			return store.Result{}, l.unknown(key, err)
		}
		now := rd.At
		absent = nil
		if !found {
			// Never written, or deleted after it expired. Had a lost write
			// of this call landed, the record would stay until at least its
			// lease + ttl.
			if lost != nil && !now.Before(instant(pending, l.ttl)) {
				return store.Result{}, fmt.Errorf("%s: claim %q: outcome unknown: a write of this call may have won the key "+
					"with a lease to %v, and the record, found gone at %v, could have expired since: %w", l.name, key, pending, now, lost)
			}
			tryCreate, absent = true, &rd
			continue
		}
		mine := cur.Token == token
		switch {
		case mine && cur.State == StateClaimed && now.Before(cur.Exp):
			// An earlier try of this call won; its reply was lost. Its
			// lease may have lapsed while the call retried, as it may
			// while any reply travels: the claim is answered as it was
			// won (a renewal would be a second effect of one call).
			return won(key, cur, cur.Version), nil
		case mine:
			// It won, but the record expired while the call retried: it
			// may be deleted at any moment and the fence start again at 1.
			return store.Result{}, l.expiredErr(key, cur, lost)
		case lost != nil && !now.Before(pending):
			return store.Result{}, fmt.Errorf("%s: claim %q: outcome unknown: a write of this call may have won the key "+
				"with a lease to %v, and the record, found in other hands at %v, could have changed hands since: %w",
				l.name, key, pending, now, lost)
		case cur.State == StateDone && now.Before(cur.Exp):
			return store.Result{Outcome: store.AlreadyDone, Until: cur.Exp, Fingerprint: cur.Fingerprint}, nil
		case cur.State == StateClaimed && now.Before(cur.Lease):
			return store.Result{Outcome: store.HeldByOther, Until: cur.Lease}, nil
		}
		// Reclaimable: the new lease runs from the read that judged it,
		// carried forward to the update. The new record keeps no
		// fingerprint of the old one.
		base, ok := l.clock.after(rd)
		if !ok {
			return store.Result{}, l.unknown(key, ErrNoServerTime)
		}
		next := Record{State: StateClaimed, Fence: cur.Fence + 1, Lease: instant(base, lease), Token: token}
		next.Exp = instant(next.Lease, l.ttl)
		v, applied, at, lostNow, err := l.st.Update(ctx, key, next, cur.Version)
		rtt := l.clock.Now().Sub(start)
		if lostNow != nil {
			pending, lost = later(pending, next.Lease), lostNow
		}
		if err != nil {
			return store.Result{}, l.unknown(key, err)
		}
		if applied {
			if l.expired(next, lost) {
				return store.Result{}, l.expiredErr(key, next, lost)
			}
			if !ranBehind(base, at, rtt) {
				return won(key, next, v), nil
			}
			res, done, err := l.rewrite(ctx, key, next, v, at, lease, &pending, &lost)
			if done || err != nil {
				return res, err
			}
		}
		// Someone wrote or deleted the record since the read (or our own
		// update applied and its reply was lost): look again.
		tryCreate = false
	}
	return store.Result{}, fmt.Errorf("%s: claim %q: still contended after %d rounds", l.name, key, maxRounds)
}

// rewrite writes again the claim rec, written as version v with a lease
// based on a time well before the commit's server time at, with the lease
// running from at. done is false when someone changed the record since
// (the lease had lapsed: the key went to another caller), for the caller
// to read and judge again.
func (l *Lock) rewrite(ctx context.Context, key string, rec Record, v int64, at time.Time, lease time.Duration,
	pending *time.Time, lost *error) (res store.Result, done bool, err error) {
	next := rec
	next.Lease = instant(at, lease)
	next.Exp = instant(next.Lease, l.ttl)
	v2, applied, _, lostNow, err := l.st.Update(ctx, key, next, v)
	if lostNow != nil {
		*pending, *lost = later(*pending, next.Lease), lostNow
	}
	if err != nil {
		return store.Result{}, true, l.unknown(key, err)
	}
	if !applied {
		return store.Result{}, false, nil
	}
	if l.expired(next, *lost) {
		return store.Result{}, true, l.expiredErr(key, next, *lost)
	}
	return won(key, next, v2), true, nil
}

// expired reports whether a claim that this call wrote after a lost reply
// (lost is not nil) belongs to a record past its expires-at instant: the
// retries outlasted lease and ttl, and the record may have been purged and
// written again by a retried create. It may be deleted at any moment, and
// the next claim would start again at fence 1: the call must not hand it
// out.
func (l *Lock) expired(r Record, lost error) bool {
	if lost == nil {
		return false
	}
	lo, _, ok := l.clock.Times()
	return !ok || !lo.Before(r.Exp)
}

func (l *Lock) expiredErr(key string, r Record, lost error) error {
	if lost == nil {
		lost = errors.New("reply lost")
	}
	return fmt.Errorf("%s: claim %q: this call won fence %d, but a reply was lost and the record expired at %v "+
		"before the call could answer (the key is free to claim): %w", l.name, key, r.Fence, r.Exp, lost)
}

func won(key string, r Record, version int64) store.Result {
	return store.Result{Outcome: store.Won, Claim: store.Claim{
		Key: key, Fence: r.Fence, Token: r.Token, LeaseExpiry: r.Lease, Rev: version,
	}}
}

func (l *Lock) unknown(key string, err error) error {
	return fmt.Errorf("%s: claim %q (outcome unknown: the key may be held until its lease lapses): %w", l.name, key, err)
}
