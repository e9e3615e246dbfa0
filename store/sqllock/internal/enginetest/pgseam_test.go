package enginetest

import (
	"context"
	"errors"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// pgRow is a PostgreSQL record as stored.
type pgRow struct {
	state, fence, lease, exp int64
	token                    string
}

// Between a Claim's two statements on PostgreSQL (its insert found the key
// taken; its full claim has not run yet) the record changes: it is purged,
// its ttl ends, its holder releases it, or the caller's ctx ends. The full
// claim decides on the record as it is then: a purged key is won afresh
// (fence 1), an expired Done record and a released one are reclaimed with
// the next fence, and a ctx that ended leaves the record alone and answers
// an error wrapping ctx.Err(), never HeldByOther or AlreadyDone. A Won
// claim's lease expiry and expires-at are the ones the row holds.
func TestPostgresRecordChangedBetweenTheClaimsTwoStatements(t *testing.T) {
	e := postgres
	dsn := e.dsn(t)
	c := &counter{}
	b := e.backend(t, e.open(t, dsn, c))
	direct := e.open(t, dsn, nil)
	other, err := sqllock.New(direct, sqllock.Postgres, sqllock.WithTable(tableOf(b)))
	if err != nil {
		t.Fatal(err)
	}
	table := `"` + tableOf(b) + `"`
	for _, between := range []string{"purged", "expired done", "released", "ctx ended"} {
		t.Run(between, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			key := "between/" + between
			first, err := other.Claim(ctx, key, time.Hour)
			if err != nil || first.Outcome != store.Won {
				t.Fatalf("the holder: %v %v", first.Outcome, err)
			}
			if between == "expired done" {
				if ok, err := other.Complete(ctx, first.Claim); !ok || err != nil {
					t.Fatalf("the holder's complete: %v %v", ok, err)
				}
			}
			var fired atomic.Bool
			var hookErr error
			hook := func(q string) {
				if !isFullClaim(q) || !fired.CompareAndSwap(false, true) {
					return
				}
				switch between {
				case "purged":
					_, hookErr = direct.ExecContext(context.Background(), "DELETE FROM "+table+" WHERE idem_key = $1", []byte(key))
				case "expired done":
					_, hookErr = direct.ExecContext(context.Background(), "UPDATE "+table+" SET expires_at_ms = expires_at_ms - 10000000000 WHERE idem_key = $1", []byte(key))
				case "released":
					hookErr = other.Release(context.Background(), first.Claim)
				case "ctx ended":
					cancel()
				}
			}
			c.beforeQuery.Store(&hook)
			r, err := b.Claim(ctx, key, time.Minute)
			c.beforeQuery.Store(nil)
			if hookErr != nil {
				t.Fatal(hookErr)
			}
			if !fired.Load() {
				t.Fatal("the claim never ran its full claim")
			}
			var got pgRow
			if err := direct.QueryRowContext(t.Context(), "SELECT state, fence, lease_expiry_ms, expires_at_ms, token FROM "+table+" WHERE idem_key = $1", []byte(key)).Scan(&got.state, &got.fence, &got.lease, &got.exp, &got.token); err != nil {
				t.Fatal(err)
			}
			if between == "ctx ended" {
				if err == nil || !errors.Is(err, context.Canceled) {
					t.Fatalf("a claim whose ctx ended between its statements: %v %v; want an error wrapping context.Canceled", r.Outcome, err)
				}
				if got.token != first.Claim.Token || got.fence != first.Claim.Fence || got.state != 1 {
					t.Fatalf("the record changed: %+v", got)
				}
				return
			}
			want := map[string]int64{"purged": 1, "expired done": 2, "released": 3}[between]
			if err != nil || r.Outcome != store.Won || r.Claim.Fence != want {
				t.Fatalf("the claim: %v fence %d %v; want won, fence %d", r.Outcome, r.Claim.Fence, err, want)
			}
			if got.state != 1 || got.fence != want || got.token != r.Claim.Token {
				t.Fatalf("the row: %+v; want claimed at fence %d by %q", got, want, r.Claim.Token)
			}
			if r.Claim.LeaseExpiry.UnixMilli() != got.lease || got.exp != got.lease+b.TTL().Milliseconds() {
				t.Fatalf("reported lease %d; the row holds lease %d, expires at %d (ttl %v)", r.Claim.LeaseExpiry.UnixMilli(), got.lease, got.exp, b.TTL())
			}
			if ok, err := b.Complete(t.Context(), r.Claim); !ok || err != nil {
				t.Fatalf("complete: %v %v", ok, err)
			}
		})
	}
}

// A fresh claim and a reclaim on PostgreSQL with the longest lease and ttl
// (math.MaxInt64 each): the plain insert and the full claim store the same
// arithmetic, the lease the claim reports, expiring the ttl (in whole
// milliseconds, rounded up) after it.
func TestPostgresLongestLeaseAndTTLOnBothClaimPaths(t *testing.T) {
	e := postgres
	dsn := e.dsn(t)
	db := e.open(t, dsn, nil)
	b := e.backend(t, db, sqllock.WithTTL(math.MaxInt64))
	table := `"` + tableOf(b) + `"`
	ctx := t.Context()
	ttlMS := store.CeilUnits(math.MaxInt64, time.Millisecond)
	check := func(what string, r store.Result, err error, fence int64) {
		t.Helper()
		if err != nil || r.Outcome != store.Won || r.Claim.Fence != fence {
			t.Fatalf("%s: %v fence %d %v", what, r.Outcome, r.Claim.Fence, err)
		}
		var lease, exp int64
		if err := db.QueryRowContext(ctx, "SELECT lease_expiry_ms, expires_at_ms FROM "+table+" WHERE idem_key = $1", []byte("k")).Scan(&lease, &exp); err != nil {
			t.Fatal(err)
		}
		if r.Claim.LeaseExpiry.UnixMilli() != lease || exp != lease+ttlMS {
			t.Fatalf("%s: reported lease %d; the row: lease %d, expires at %d (want lease + %d)", what, r.Claim.LeaseExpiry.UnixMilli(), lease, exp, ttlMS)
		}
		if min := time.Now().Add(-time.Minute).UnixMilli() + store.CeilUnits(math.MaxInt64, time.Millisecond); lease < min {
			t.Fatalf("%s: lease %d, want at least now + the longest lease (%d)", what, lease, min)
		}
	}
	r, err := b.Claim(ctx, "k", math.MaxInt64)
	check("fresh", r, err, 1)
	if err := b.Release(ctx, r.Claim); err != nil {
		t.Fatal(err)
	}
	r, err = b.Claim(ctx, "k", math.MaxInt64)
	check("reclaim", r, err, 3)
}
