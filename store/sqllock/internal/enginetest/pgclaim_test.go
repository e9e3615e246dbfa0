package enginetest

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// isFreshInsert reports whether q is PostgreSQL's first statement of a
// Claim: the plain insert that does nothing when the key is taken.
func isFreshInsert(q string) bool {
	return strings.HasPrefix(q, "INSERT INTO") && strings.Contains(q, "DO NOTHING")
}

// isFullClaim reports whether q is PostgreSQL's full Claim, which a Claim
// runs when its fresh insert found the key taken.
func isFullClaim(q string) bool { return strings.HasPrefix(q, "WITH clock") }

// kinds names the statements sent, for a test's messages.
func kinds(sent []string) []string {
	var k []string
	for _, q := range sent {
		switch {
		case isFreshInsert(q):
			k = append(k, "fresh insert")
		case isFullClaim(q):
			k = append(k, "full claim")
		default:
			k = append(k, firstWords(q))
		}
	}
	return k
}

func firstWords(q string) string {
	if f := strings.Fields(q); len(f) > 3 {
		return strings.Join(f[:3], " ") + " ..."
	}
	return q
}

// A fresh claim on PostgreSQL is one statement, a plain insert, and the
// lease expiry it reports is the one the row holds, by the server's clock;
// a claim of a taken key is two (the insert, which does nothing, and the
// full claim), and reports the holder's lease.
func TestPostgresFreshClaimIsOneInsertAndReportsTheStoredLease(t *testing.T) {
	e := postgres
	c := &counter{}
	db, b := e.fresh(t, c)
	ctx := t.Context()
	if _, err := b.Claim(ctx, "warm-up", time.Minute); err != nil {
		t.Fatal(err)
	}
	var sent []string
	var mu sync.Mutex
	hook := func(q string) { mu.Lock(); sent = append(sent, q); mu.Unlock() }
	c.beforeQuery.Store(&hook)
	for i := range 5 {
		key := fmt.Sprint("fresh-", i)
		c.n.Store(0)
		sent = nil
		r, err := b.Claim(ctx, key, time.Duration(i+1)*time.Minute)
		if err != nil || r.Outcome != store.Won || r.Claim.Fence != 1 {
			t.Fatalf("claim: %v fence %d %v", r.Outcome, r.Claim.Fence, err)
		}
		if n := c.n.Load(); n != 1 || len(sent) != 1 || !isFreshInsert(sent[0]) {
			t.Errorf("a fresh claim took %d statements (%q), want 1: the plain insert", n, kinds(sent))
		}
		var lease, exp int64
		var token string
		if err := db.QueryRowContext(ctx, "SELECT lease_expiry_ms, expires_at_ms, token FROM "+tableOf(b)+" WHERE idem_key = $1", []byte(key)).Scan(&lease, &exp, &token); err != nil {
			t.Fatal(err)
		}
		if got := r.Claim.LeaseExpiry.UnixMilli(); got != lease {
			t.Fatalf("reported lease expiry %d, the row holds %d", got, lease)
		}
		if exp != lease+b.TTL().Milliseconds() {
			t.Fatalf("expires at %d, want the lease expiry %d + the ttl", exp, lease)
		}
		if token != r.Claim.Token {
			t.Fatalf("the row holds token %q, the claim %q", token, r.Claim.Token)
		}
		c.n.Store(0)
		sent = nil
		if r, err := b.Claim(ctx, key, time.Minute); err != nil || r.Outcome != store.HeldByOther || r.Until.UnixMilli() != lease {
			t.Fatalf("second claim: %v until %v %v; want held until %d", r.Outcome, r.Until, err, lease)
		}
		if n := c.n.Load(); n != 2 || len(sent) != 2 || !isFreshInsert(sent[0]) || !isFullClaim(sent[1]) {
			t.Errorf("a claim of a taken key took %d statements (%q), want 2: the insert, then the full claim", n, kinds(sent))
		}
	}
}

// The reply of a fresh claim's insert is lost (the insert landed, the
// connection is cut): the retry, with the same token, finds the key taken
// by that insert, and the full claim's branch for its own token answers
// Won, fence 1, with the lease the row holds; the row is unchanged.
func TestPostgresLostReplyOfTheFreshInsertEndsInWonWithTheStoredLease(t *testing.T) {
	e := postgres
	dsn := e.dsn(t)
	host := serverAddr(e, dsn)
	proxy := testsvc.NewDropProxy(t, host)
	c := &counter{}
	db := e.open(t, strings.Replace(dsn, host, proxy.Addr(), 1), c)
	db.SetMaxOpenConns(1)
	b := e.backend(t, db)
	direct := e.open(t, dsn, nil)
	ctx := t.Context()
	if _, err := b.Claim(ctx, "warm-up", time.Minute); err != nil {
		t.Fatal(err)
	}
	var sent []string
	var mu sync.Mutex
	hook := func(q string) { mu.Lock(); sent = append(sent, q); mu.Unlock() }
	c.beforeQuery.Store(&hook)
	proxy.LoseNextReply()
	r, err := b.Claim(ctx, "k", time.Minute)
	c.beforeQuery.Store(nil)
	if proxy.Dropped.Load() != 1 {
		t.Fatalf("dropped %d replies, want 1", proxy.Dropped.Load())
	}
	if len(sent) == 0 || !isFreshInsert(sent[0]) {
		t.Fatalf("the statements sent: %q; want the lost one to be the fresh insert", kinds(sent))
	}
	if k := kinds(sent); len(k) != 3 || k[1] != "fresh insert" || k[2] != "full claim" {
		t.Fatalf("the statements sent: %q; want the lost insert, then the retry's insert (the key taken by the lost one) and its full claim", k)
	}
	if err != nil || r.Outcome != store.Won || r.Claim.Fence != 1 {
		t.Fatalf("claim whose insert's reply was lost: %v fence %d %v; want won, fence 1", r.Outcome, r.Claim.Fence, err)
	}
	var state, fence, lease, exp int64
	var token string
	if err := direct.QueryRowContext(ctx, "SELECT state, fence, lease_expiry_ms, expires_at_ms, token FROM "+tableOf(b)+" WHERE idem_key = $1", []byte("k")).Scan(&state, &fence, &lease, &exp, &token); err != nil {
		t.Fatal(err)
	}
	if state != 1 || fence != 1 || token != r.Claim.Token {
		t.Fatalf("row: state %d fence %d token %q; want claimed, fence 1 and the claim's token %q", state, fence, token, r.Claim.Token)
	}
	if got := r.Claim.LeaseExpiry.UnixMilli(); got != lease {
		t.Fatalf("reported lease expiry %d, the row holds %d (the lost insert's)", got, lease)
	}
	if exp != lease+b.TTL().Milliseconds() {
		t.Fatalf("expires at %d, want the lease expiry %d + the ttl", exp, lease)
	}
	if other, err := b.Claim(ctx, "k", time.Minute); err != nil || other.Outcome != store.HeldByOther || other.Until.UnixMilli() != lease {
		t.Fatalf("another claim: %v until %v %v; want held until %d", other.Outcome, other.Until, err, lease)
	}
	if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
		t.Fatalf("complete: %v %v", ok, err)
	}
}

// A claimer whose insert found the key taken runs its full claim next;
// between the two, another claimer takes the key (its lease had lapsed,
// or its holder released it). Exactly one of them wins: the first answers
// HeldByOther until the winner's lease.
func TestPostgresClaimerOvertakenBetweenItsTwoStatementsDoesNotAlsoWin(t *testing.T) {
	e := postgres
	dsn := e.dsn(t)
	c := &counter{}
	b := e.backend(t, e.open(t, dsn, c))
	other, err := sqllock.New(e.open(t, dsn, nil), sqllock.Postgres, sqllock.WithTable(tableOf(b)))
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	for _, before := range []string{"lapsed", "released"} {
		t.Run(before, func(t *testing.T) {
			key := "overtaken/" + before
			first, err := other.Claim(ctx, key, time.Millisecond)
			if err != nil || first.Outcome != store.Won {
				t.Fatalf("first holder: %v %v", first.Outcome, err)
			}
			if before == "released" {
				if err := other.Release(ctx, first.Claim); err != nil {
					t.Fatal(err)
				}
			} else {
				time.Sleep(20 * time.Millisecond) // the 1ms lease lapses on the server's clock
			}
			var fired atomic.Bool
			var overtaker store.Result
			var overtakerErr error
			hook := func(q string) {
				if !isFullClaim(q) || !fired.CompareAndSwap(false, true) {
					return
				}
				// Our insert found the key taken; another caller takes it
				// before our full claim runs.
				overtaker, overtakerErr = other.Claim(ctx, key, time.Hour)
			}
			c.beforeQuery.Store(&hook)
			defer c.beforeQuery.Store(nil)
			r, err := b.Claim(ctx, key, time.Hour)
			if !fired.Load() {
				t.Fatal("the hook never ran: the claim did not run its full claim after its insert")
			}
			want := map[string]int64{"lapsed": 2, "released": 3}[before] // a release raises the fence
			if overtakerErr != nil || overtaker.Outcome != store.Won || overtaker.Claim.Fence != want {
				t.Fatalf("the overtaking claimer: %v fence %d %v; want won with fence %d", overtaker.Outcome, overtaker.Claim.Fence, overtakerErr, want)
			}
			if err != nil || r.Outcome != store.HeldByOther || !r.Until.Equal(overtaker.Claim.LeaseExpiry) {
				t.Fatalf("the overtaken claimer: %v until %v %v; want held by the winner until %v (two winners otherwise)", r.Outcome, r.Until, err, overtaker.Claim.LeaseExpiry)
			}
		})
	}
}
