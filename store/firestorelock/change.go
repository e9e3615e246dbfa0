package firestorelock

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// holds reports whether r is the record of claim c (or of the changes c
// made of it): the same fence and token. The token tells c apart
// from a claim with the same fence on a record created afresh after an
// earlier one was deleted.
func holds(r record, c store.Claim) bool { return r.fence == c.Fence && r.token == c.Token }

// sameRecord reports whether a and b hold the same values (versions
// aside).
func sameRecord(a, b record) bool {
	return a.state == b.state && a.fence == b.fence && a.token == b.token && a.lease.Equal(b.lease) && a.exp.Equal(b.exp)
}

// takeable is the instant from which a party other than the writer may
// change record r: a Claimed record once its lease lapses, a Done one once
// its ttl ends.
func takeable(r record) time.Time {
	if r.state == stateDone {
		return r.exp
	}
	return r.lease
}

// changed is what change found or did.
type changed struct {
	rec   record // the record as written, or as last read (when found)
	found bool   // a record exists
	wrote bool   // this call's write applied
	// unsure: a write of this call whose reply was lost may have applied,
	// and the record was then found without the claim's fence (or gone) at
	// a time when others could have changed it since: the caller cannot
	// tell whether its write happened. lost is that write's error.
	unsure bool
	lost   error
}

// change applies f to the record of claim c with a write preconditioned on
// the record's update time. f sees
// the current record and the server's time now (its upper bound), and says
// what to write, or stops. Only the claim's fence and token entitle a change.
//
// When the claim carries the update time its write left and the server's
// time is known, the first round trusts the claim's own view of the
// record and skips the read: if the record changed since, the
// preconditioned write does not apply, and the next round reads it.
func (b *Backend) change(ctx context.Context, c store.Claim, f func(cur record, now time.Time) (next record, write bool)) (changed, error) {
	cur := fromClaim(c, b.ttl)
	known := c.Rev != 0
	var (
		pending time.Time
		lost    error
		sent    []record // what the writes whose replies were lost carried
	)
	for range maxRounds {
		_, now, fresh := b.times()
		read := false
		if !known || !fresh {
			r, found, rd, err := b.lookup(ctx, c.Key)
			if err != nil {
				return changed{}, err
			}
			readAt := rd.at
			if found && slices.ContainsFunc(sent, func(s record) bool { return sameRecord(s, r) }) {
				// A write of this call landed; its reply was lost. Writing
				// again would be a second effect.
				return changed{rec: r, found: true, wrote: true}, nil
			}
			if lost != nil && (!found || !holds(r, c)) && !readAt.Before(pending) {
				return changed{rec: r, found: found, unsure: true, lost: lost}, nil
			}
			if !found {
				return changed{}, nil
			}
			cur, known, read = r, true, true
			if now, fresh = b.after(rd); !fresh {
				return changed{}, errNoServerTime
			}
		}
		next, write := f(cur, now)
		if !write {
			return changed{rec: cur, found: true}, nil
		}
		v, applied, at, lostNow, err := b.write(ctx, update(b.document(c.Key, next), cur.version))
		if lostNow != nil {
			pending, lost, sent = later(pending, takeable(next)), lostNow, append(sent, next)
		}
		if err != nil {
			return changed{}, err
		}
		if applied {
			if !read && misplaced(now, at) {
				return changed{}, fmt.Errorf("outcome unknown: written with instants from %v, an estimate of the server's time "+
					"that ran ahead of the commit at %v", now, at)
			}
			next.version = v
			return changed{rec: next, found: true, wrote: true}, nil
		}
		known = false // changed or gone under us: read it and decide again
	}
	return changed{}, fmt.Errorf("still contended after %d rounds", maxRounds)
}

// fromClaim is what the record looks like while c holds it unchanged, for
// an update that knows the version but has not read the document.
func fromClaim(c store.Claim, ttl time.Duration) record {
	return record{state: stateClaimed, fence: c.Fence, lease: c.LeaseExpiry, exp: c.LeaseExpiry.Add(ttl), token: c.Token, version: unrev(c.Rev)}
}

// Complete implements store.Backend: one write preconditioned on the update
// time the claim left, when the claim is unchanged. The Done record
// expires a ttl after the server's time (its upper bound) when the write
// was sent. When a retry after a lost reply
// finds the record in other hands at a time when the completion, had it
// applied, could already have expired and been reclaimed, Complete returns
// an error: it cannot tell.
func (b *Backend) Complete(ctx context.Context, c store.Claim) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	res, err := b.change(ctx, c, func(cur record, now time.Time) (record, bool) {
		if !holds(cur, c) || cur.state == stateDone {
			return cur, false
		}
		cur.state, cur.exp = stateDone, now.Add(b.ttl)
		return cur, true
	})
	if err != nil {
		return false, fmt.Errorf("firestorelock: complete %q fence %d: %w", c.Key, c.Fence, err)
	}
	if res.unsure {
		return false, fmt.Errorf("firestorelock: complete %q fence %d: outcome unknown: a completion whose reply was lost "+
			"may have applied and expired before the record was found in other hands: %w", c.Key, c.Fence, res.lost)
	}
	return res.found && holds(res.rec, c) && res.rec.state == stateDone, nil
}

// Release implements store.Backend: one write preconditioned on the update
// time the claim left, when the claim is unchanged. The lease is set to the server's time (its upper bound) when
// the update is sent, so the key is reclaimable once the update applies
// (give or take the latency of the request that brought the estimate).
func (b *Backend) Release(ctx context.Context, c store.Claim) error {
	if err := store.ValidateKey(c.Key); err != nil {
		return err
	}
	_, err := b.change(ctx, c, func(cur record, now time.Time) (record, bool) {
		if !holds(cur, c) || cur.state != stateClaimed {
			return cur, false
		}
		cur.fence++
		cur.lease, cur.exp = now, now.Add(b.ttl)
		return cur, true
	})
	if err != nil {
		return fmt.Errorf("firestorelock: release %q fence %d: %w", c.Key, c.Fence, err)
	}
	return nil
}

// Extend implements store.Extender: the lease runs for lease from the
// server's time (its upper bound) when the update was sent.
func (b *Backend) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return c, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return c, err
	}
	lease = wholeMicros(lease)
	res, err := b.change(ctx, c, func(cur record, now time.Time) (record, bool) {
		if !holds(cur, c) || cur.state != stateClaimed {
			return cur, false
		}
		cur.lease = now.Add(lease)
		cur.exp = cur.lease.Add(b.ttl)
		return cur, true
	})
	if err != nil {
		return c, fmt.Errorf("firestorelock: extend %q fence %d: %w", c.Key, c.Fence, err)
	}
	if !res.wrote {
		return c, fmt.Errorf("firestorelock: extend %q fence %d: %w", c.Key, c.Fence, store.ErrLost)
	}
	c.LeaseExpiry, c.Rev = res.rec.lease, rev(res.rec.version)
	return c, nil
}
