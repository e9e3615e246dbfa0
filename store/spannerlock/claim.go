package spannerlock

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"cloud.google.com/go/spanner"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// errClaimLanded ends a Claim whose Commit was answered as lost (NotFound
// or FailedPrecondition naming the transaction) by a strong read that
// found the write applied: the call answers Won.
var errClaimLanded = errors.New("spannerlock: the claim's write applied")

var columns = []string{"key", "state", "fence", "lease_expiry", "expires_at", "token", "fingerprint"}

// row is a record as read, with the server's time of the read.
type row struct {
	now     time.Time
	present bool
	state   int64
	fence   int64
	lease   time.Time
	exp     time.Time
	token   string
	fp      string // the payload fingerprint of a Done row; "" for none
}

// querier is a transaction that runs queries: a read-write one, or a
// single-use read-only one.
type querier interface {
	Query(ctx context.Context, stmt spanner.Statement) *spanner.RowIterator
}

// read reads key's row in txn together with CURRENT_TIMESTAMP(), in one
// statement (in a read-write transaction, its first: it begins the
// transaction inline).
func (b *Backend) read(ctx context.Context, txn querier, key string) (row, error) {
	stmt := spanner.Statement{
		SQL: "SELECT CURRENT_TIMESTAMP(), r.state, r.fence, r.lease_expiry, r.expires_at, r.token, r.fingerprint " +
			"FROM UNNEST([1]) AS one LEFT JOIN " + b.table + " AS r ON r.key = @key",
		Params: map[string]any{"key": []byte(key)},
	}
	var r row
	err := txn.Query(ctx, stmt).Do(func(res *spanner.Row) error {
		var (
			state, fence spanner.NullInt64
			lease, exp   spanner.NullTime
			token, fp    spanner.NullString
		)
		if err := res.Columns(&r.now, &state, &fence, &lease, &exp, &token, &fp); err != nil {
			return err
		}
		r.present = state.Valid
		r.state, r.fence, r.lease, r.exp, r.token, r.fp = state.Int64, fence.Int64, lease.Time, exp.Time, token.StringVal, fp.StringVal
		return nil
	})
	if err != nil {
		return r, err
	}
	if r.now.IsZero() {
		return r, fmt.Errorf("spannerlock: the read of %q returned no row", key)
	}
	if r.present && ((r.state != stateClaimed && r.state != stateDone) || r.fence < 1) {
		return r, fmt.Errorf("spannerlock: the row of %q is not a record of this backend (state %d, fence %d)", key, r.state, r.fence)
	}
	return r, nil
}

// Claim creates or reclaims key's record in one read-write transaction:
// a query reads the row and CURRENT_TIMESTAMP(), and the commit carries
// the insert or update that the row calls for (2 RPCs). See the package
// doc for how a lost commit reply is told apart.
func (b *Backend) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Result{}, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return store.Result{}, err
	}
	token := store.NewToken()
	var (
		res store.Result
		// maybe are the writes of earlier runs of this call whose commit
		// may have applied, unknown.
		maybe []attempt
		// cur is the write the last body run buffered, until its outcome
		// is known; nil when it buffered none.
		cur *attempt
	)
	body := func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
		if cur != nil {
			// The Spanner client runs the body again after a Commit that
			// failed with Aborted, Internal or ResourceExhausted, without
			// saying which: Internal (a connection that broke mid-reply)
			// leaves the write unknown.
			maybe = append(maybe, *cur)
			cur = nil
		}
		r, err := b.read(ctx, txn, key)
		if err != nil {
			return err
		}
		maybe = b.prune(maybe, token, r)
		var m *spanner.Mutation
		res, m, err = b.decide(key, token, lease, r, maybe)
		if err != nil {
			return err
		}
		if m == nil {
			return nil
		}
		if err := txn.BufferWrite([]*spanner.Mutation{m}); err != nil {
			return err
		}
		cur = &attempt{fence: res.Claim.Fence, expiry: res.Claim.LeaseExpiry}
		return nil
	}
	err := b.transact(ctx, body, func(err error) error {
		if cur != nil && unknownCommit(err) {
			maybe = append(maybe, *cur)
			if txLost(err) {
				// Unless the Spanner client resent the Commit after a lost
				// reply, the transaction is gone and wrote nothing (the
				// emulator forgets all but one of a database's concurrent
				// transactions). Tell the two apart now, while the lease
				// the write stored would still be running.
				if r, rerr := b.read(ctx, b.client.Single(), key); rerr == nil {
					if r.present && r.token == token && r.state == stateClaimed && r.now.Before(r.exp) {
						res = won(key, token, r.fence, r.lease)
						cur = nil
						return errClaimLanded
					}
					maybe = b.prune(maybe, token, r)
				}
			}
		}
		cur = nil
		return err
	})
	if errors.Is(err, errClaimLanded) {
		return res, nil
	}
	if err != nil {
		return store.Result{}, fmt.Errorf("spannerlock: claim %q: %w", key, err)
	}
	return res, nil
}

// attempt is the write of one run of a Claim: the fence and the lease
// expiry it stores with the call's token.
type attempt struct {
	fence  int64
	expiry time.Time
}

// decide judges row r by its read instant and returns Claim's result and
// the write it needs (nil for none). maybe are the writes of earlier runs
// of the same call that may have applied.
func (b *Backend) decide(key, token string, lease time.Duration, r row, maybe []attempt) (store.Result, *spanner.Mutation, error) {
	now := r.now
	if r.present && r.token == token && r.state == stateClaimed {
		// An earlier run of this call committed; its reply was lost.
		if !now.Before(r.exp) {
			return store.Result{}, nil, fmt.Errorf("%w (our own claim expired at %v; the row may be deleted at any moment)", errUnknown, r.exp)
		}
		return won(key, token, r.fence, r.lease), nil, nil
	}
	for _, a := range maybe {
		if !b.ruledOut(a, r) {
			// Had that write applied, its lease would have lapsed by now
			// and others could have taken the key from it since.
			return store.Result{}, nil, fmt.Errorf("%w (a write of fence %d whose lease ended at %v may have applied; the row has fence %d now)", errUnknown, a.fence, a.expiry, r.fence)
		}
	}
	// The port's arithmetic: rounded up to whole microseconds, capped at
	// store.MaxInstant, never wrapped.
	expiry := store.Instant(now, time.Microsecond, lease)
	expires := store.Instant(expiry, time.Microsecond, b.ttl)
	vals := func(fence int64) []any {
		// A claim starts without a fingerprint: a reclaim clears the
		// one an earlier life of the row left.
		return []any{[]byte(key), int64(stateClaimed), fence, expiry, expires, token, spanner.NullString{}}
	}
	switch {
	case !r.present:
		return won(key, token, 1, expiry), spanner.Insert(b.table, columns, vals(1)), nil
	case r.state == stateClaimed && now.Before(r.lease):
		return store.Result{Outcome: store.HeldByOther, Until: r.lease}, nil, nil
	case r.state == stateDone && now.Before(r.exp):
		return store.Result{Outcome: store.AlreadyDone, Until: r.exp, Fingerprint: r.fp}, nil, nil
	}
	return won(key, token, r.fence+1, expiry), spanner.Update(b.table, columns, vals(r.fence+1)), nil
}

// prune returns maybe without the writes that row r rules out. A write
// ruled out once never applies later: it was answered before r was read.
// A row that holds token rules nothing out (decide answers from it).
func (b *Backend) prune(maybe []attempt, token string, r row) []attempt {
	if r.present && r.token == token {
		return maybe
	}
	return slices.DeleteFunc(maybe, func(a attempt) bool { return b.ruledOut(a, r) })
}

// ruledOut reports whether row r, which does not hold the call's token,
// shows that write a did not apply. Had it applied, the row would hold
// the token until a's lease lapsed, then a fence above a's once another
// claim took the key over, and it could not be deleted before a's
// expires-at instant (its lease expiry plus the ttl): so a row read before
// a's lease expiry, or before that instant with no row or a fence no
// higher than a's, rules it out.
func (b *Backend) ruledOut(a attempt, r row) bool {
	switch {
	case r.now.Before(a.expiry):
		return true
	case !r.now.Before(store.Instant(a.expiry, 0, b.ttl)):
		return false
	}
	return !r.present || r.fence <= a.fence
}

func won(key, token string, fence int64, expiry time.Time) store.Result {
	return store.Result{Outcome: store.Won, Claim: store.Claim{Key: key, Fence: fence, Token: token, LeaseExpiry: expiry}}
}
