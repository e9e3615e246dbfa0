package doclock

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// holds reports whether r is the record of claim c (or of the changes c
// made of it): the same fence and token. The token tells c apart from a
// claim with the same fence on a record created afresh after an earlier
// one was deleted.
func holds(r Record, c store.Claim) bool { return r.Fence == c.Fence && r.Token == c.Token }

// sameRecord reports whether a and b hold the same values (versions
// aside).
func sameRecord(a, b Record) bool {
	return a.State == b.State && a.Fence == b.Fence && a.Token == b.Token && a.Lease.Equal(b.Lease) && a.Exp.Equal(b.Exp) &&
		a.Fingerprint == b.Fingerprint
}

// takeable is the instant from which a party other than the writer may
// change record r: a Claimed record once its lease lapses, a Done one once
// its ttl ends.
func takeable(r Record) time.Time {
	if r.State == StateDone {
		return r.Exp
	}
	return r.Lease
}

// changed is what change found or did.
type changed struct {
	rec   Record // the record as written, or as last read (when found)
	found bool   // a record exists
	wrote bool   // this call's write applied
	// unsure: a write of this call whose reply was lost may have applied,
	// and the record was then found without the claim's fence (or gone) at
	// a time when others could have changed it since: the caller cannot
	// tell whether its write happened. lost is that write's error.
	unsure bool
	lost   error
}

// change applies f to the record of claim c with an update conditioned on
// the record's version. f sees the current record and the server's time
// now (its upper bound), and says what to write, or stops. Only the
// claim's fence and token entitle a change.
//
// When the claim carries the record's version and the server's time is
// known, the first round trusts the claim's own view of the record and
// skips the read: if the record changed since, the conditioned update does
// not apply, and the next round reads it.
func (l *Lock) change(ctx context.Context, c store.Claim, f func(cur Record, now time.Time) (next Record, write bool)) (changed, error) {
	start := l.clock.Now() // the call began: no instant it writes may lie before it
	cur := fromClaim(c, l.ttl)
	known := c.Rev != 0
	var (
		pending time.Time
		lost    error
		sent    []Record // what the writes whose replies were lost carried
	)
	for range maxRounds {
		now, fresh := l.clock.estimate()
		read := false
		if !known || !fresh {
			r, found, rd, err := l.st.Read(ctx, c.Key)
			if err != nil {
				return changed{}, err
			}
			if found && slices.ContainsFunc(sent, func(s Record) bool { return sameRecord(s, r) }) {
				// A write of this call landed; its reply was lost. Writing
				// again would be a second effect.
				return changed{rec: r, found: true, wrote: true}, nil
			}
			if lost != nil && (!found || !holds(r, c)) && !rd.At.Before(pending) {
				return changed{rec: r, found: found, unsure: true, lost: lost}, nil
			}
			if !found {
				return changed{}, nil
			}
			cur, known, read = r, true, true
			if now, fresh = l.clock.after(rd); !fresh {
				return changed{}, ErrNoServerTime
			}
		}
		next, write := f(cur, now)
		if !write {
			return changed{rec: cur, found: true}, nil
		}
		v, applied, at, lostNow, err := l.st.Update(ctx, c.Key, next, cur.Version)
		rtt := l.clock.Now().Sub(start)
		if lostNow != nil {
			pending, lost, sent = later(pending, takeable(next)), lostNow, append(sent, next)
		}
		if err != nil {
			return changed{}, err
		}
		if applied {
			if !read && ranAhead(now, at) {
				return changed{}, fmt.Errorf("outcome unknown: written with instants from %v, an estimate of the server's time "+
					"that ran ahead of the commit at %v", now, at)
			}
			next.Version = v
			if ranBehind(now, at, rtt) {
				// Written from a time before the call began (by the
				// server's clock): its lease or ttl ends early. Write it
				// again from the commit's time; should that fail, the
				// write stands as it is.
				if fixed, write := f(cur, at); write {
					if v2, ok, _, _, err := l.st.Update(ctx, c.Key, fixed, v); err == nil && ok {
						fixed.Version = v2
						next = fixed
					}
				}
			}
			return changed{rec: next, found: true, wrote: true}, nil
		}
		known = false // changed or gone under us: read it and decide again
	}
	return changed{}, fmt.Errorf("still contended after %d rounds", maxRounds)
}

// fromClaim is what the record looks like while c holds it unchanged, for
// an update that knows the version but has not read the record.
func fromClaim(c store.Claim, ttl time.Duration) Record {
	return Record{State: StateClaimed, Fence: c.Fence, Lease: c.LeaseExpiry, Exp: instant(c.LeaseExpiry, ttl), Token: c.Token, Version: c.Rev}
}

// Complete implements store.Backend.Complete: CompleteFingerprint with no
// fingerprint.
func (l *Lock) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return l.complete(ctx, c, "")
}

// CompleteFingerprint implements store.Fingerprinter: one update
// conditioned on the version the claim left, when the claim is unchanged,
// that moves the record to Done with fingerprint fp (none when empty). The
// Done record expires a ttl after the server's time (its upper bound) when
// the update was sent. A record already Done by this claim is left as it
// is, its fingerprint included. When a retry after a lost reply finds the
// record in other hands at a time when the completion, had it applied,
// could already have expired and been reclaimed, it returns an error: it
// cannot tell.
func (l *Lock) CompleteFingerprint(ctx context.Context, c store.Claim, fp string) (bool, error) {
	if err := store.ValidateFingerprint(fp); err != nil {
		return false, err
	}
	return l.complete(ctx, c, fp)
}

func (l *Lock) complete(ctx context.Context, c store.Claim, fp string) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	res, err := l.change(ctx, c, func(cur Record, now time.Time) (Record, bool) {
		if !holds(cur, c) || cur.State == StateDone {
			return cur, false
		}
		cur.State, cur.Exp, cur.Fingerprint = StateDone, instant(now, l.ttl), fp
		return cur, true
	})
	if err != nil {
		return false, fmt.Errorf("%s: complete %q fence %d: %w", l.name, c.Key, c.Fence, err)
	}
	if res.unsure {
		return false, fmt.Errorf("%s: complete %q fence %d: outcome unknown: a completion whose reply was lost "+
			"may have applied and expired before the record was found in other hands: %w", l.name, c.Key, c.Fence, res.lost)
	}
	return res.found && holds(res.rec, c) && res.rec.State == StateDone, nil
}

// Release implements store.Backend.Release: one conditioned update when
// the claim is unchanged. The lease is set to the server's time (its upper
// bound) when the update is sent, so the key is reclaimable once the
// update applies (give or take the latency of the request that brought
// the estimate).
func (l *Lock) Release(ctx context.Context, c store.Claim) error {
	if err := store.ValidateKey(c.Key); err != nil {
		return err
	}
	_, err := l.change(ctx, c, func(cur Record, now time.Time) (Record, bool) {
		if !holds(cur, c) || cur.State != StateClaimed {
			return cur, false
		}
		cur.Fence++
		cur.Lease, cur.Exp = now, instant(now, l.ttl)
		return cur, true
	})
	if err != nil {
		return fmt.Errorf("%s: release %q fence %d: %w", l.name, c.Key, c.Fence, err)
	}
	return nil
}

// Extend implements store.Extender: the lease runs for lease from the
// server's time (its upper bound) when the update was sent. It waits while
// a transactional completion of c holds its turn ([Lock.Committing]).
func (l *Lock) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return c, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return c, err
	}
	end, err := l.gates.enter(ctx, gateOf(c))
	if err != nil {
		return c, fmt.Errorf("%s: extend %q fence %d: %w", l.name, c.Key, c.Fence, err)
	}
	defer end()
	res, err := l.change(ctx, c, func(cur Record, now time.Time) (Record, bool) {
		if !holds(cur, c) || cur.State != StateClaimed {
			return cur, false
		}
		cur.Lease = instant(now, lease)
		cur.Exp = instant(cur.Lease, l.ttl)
		return cur, true
	})
	if err != nil {
		return c, fmt.Errorf("%s: extend %q fence %d: %w", l.name, c.Key, c.Fence, err)
	}
	if !res.wrote {
		return c, fmt.Errorf("%s: extend %q fence %d: %w", l.name, c.Key, c.Fence, store.ErrLost)
	}
	c.LeaseExpiry, c.Rev = res.rec.Lease, res.rec.Version
	return c, nil
}
