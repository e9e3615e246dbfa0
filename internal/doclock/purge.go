package doclock

import (
	"context"
	"fmt"
	"time"
)

// PurgeBatch is how many records one round of [Lock.Purge] reads and
// deletes.
const PurgeBatch = 500

// Expired is a record that a purge query found: its expires_at (which may
// be time.Time{}, 0001-01-01T00:00:00Z, an instant long past: a record
// without an expires_at is not an Expired) and the backend's handle to
// delete it by (its name and the version the query saw).
type Expired struct {
	Exp time.Time
	Ref any
}

// PurgeStore is what a backend does on its service for [Lock.Purge], each
// call retried as the backend's WithRetries says.
type PurgeStore interface {
	// Probe reads the server's time (or learns that the service gives
	// none), by a read of a name that no key is stored under.
	Probe(ctx context.Context) error
	// Expired queries at most limit records whose expires_at is not after
	// lo, and leaves out those of them without an expires_at. readAt is
	// the query's server time (zero when the reply carries none), which
	// the backend has passed to the Clock; last reports that no record
	// past these matches.
	Expired(ctx context.Context, lo time.Time, limit int) (found []Expired, readAt time.Time, last bool, err error)
	// Delete deletes recs, each on the condition that it is still the
	// version the query saw (a record reclaimed since stays), and returns
	// how many it deleted.
	Delete(ctx context.Context, recs []Expired) (int, error)
}

// Purge implements store.Purger's PurgeExpired on ps, for databases
// without a TTL policy on expires_at: rounds of a query of at most
// PurgeBatch records whose expires_at has passed by the lower bound of
// the server's time, each followed by the deletion of those whose
// expires_at is not after the query's read time either, until a round is
// the query's last or deletes nothing, or limit records (when positive)
// are deleted. A client clock that runs fast cannot make it delete early.
func (l *Lock) Purge(ctx context.Context, limit int, ps PurgeStore) (int, error) {
	total := 0
	for limit <= 0 || total < limit {
		lo, _, ok := l.clock.Times()
		if !ok {
			if err := ps.Probe(ctx); err != nil {
				return total, fmt.Errorf("%s: purge: reading the server's time: %w", l.name, err)
			}
			if lo, _, ok = l.clock.Times(); !ok {
				return total, fmt.Errorf("%s: purge: %w", l.name, ErrNoServerTime)
			}
		}
		batch := PurgeBatch
		if limit > 0 && limit-total < PurgeBatch {
			batch = limit - total
		}
		found, readAt, last, err := ps.Expired(ctx, lo, batch)
		if err != nil {
			return total, fmt.Errorf("%s: purge query: %w", l.name, err)
		}
		expired := found[:0:0]
		for _, r := range found {
			if r.Exp.After(lo) || (!readAt.IsZero() && r.Exp.After(readAt)) {
				continue // not expired by the server's reckoning
			}
			expired = append(expired, r)
		}
		if len(expired) == 0 {
			return total, nil
		}
		deleted, err := ps.Delete(ctx, expired)
		if err != nil {
			return total, fmt.Errorf("%s: purge delete: %w", l.name, err)
		}
		total += deleted
		// A service may return fewer results than the limit with more to
		// come (the Datastore emulator stops at 300): only a batch that
		// says it is the last, or that deleted nothing, ends the purge.
		if last || deleted == 0 {
			return total, nil
		}
	}
	return total, nil
}
