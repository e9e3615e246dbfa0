package spannerlock_test

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
)

// The round trips the package doc states, counted by a gRPC interceptor:
// each call is one read-write transaction begun inline by its first
// statement, so one statement and the Commit; a fresh delivery (Claim and
// Complete) costs 4.
func TestRPCsPerOperation(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	b, r := newBackend(t, "")
	b.Claim(ctx, "warm-up", time.Minute) // the client's sessions
	r.take()
	want := func(op string, calls ...string) {
		t.Helper()
		if got := r.take(); !slices.Equal(got, calls) {
			t.Errorf("%s sent %v, want %v", op, got, calls)
		}
	}
	read, dml := "ExecuteStreamingSql", "ExecuteSql"
	res, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || res.Outcome != store.Won {
		t.Fatalf("claim: %v %v", res.Outcome, err)
	}
	want("Claim of a fresh key", read, "Commit")
	if ok, err := b.Complete(ctx, res.Claim); !ok || err != nil {
		t.Fatalf("complete: %v %v", ok, err)
	}
	want("Complete", read, "Commit")
	if res, _ := b.Claim(ctx, "k", time.Minute); res.Outcome != store.AlreadyDone {
		t.Fatalf("claim of a done key: %v", res.Outcome)
	}
	want("Claim of a done key", read, "Commit")

	res, _ = b.Claim(ctx, "short", time.Millisecond)
	r.take()
	time.Sleep(10 * time.Millisecond)
	res2, err := b.Claim(ctx, "short", time.Minute)
	if err != nil || res2.Outcome != store.Won || res2.Claim.Fence != 2 {
		t.Fatalf("reclaim: %+v %v", res2, err)
	}
	want("Claim of a lapsed key", read, "Commit")
	if _, err := b.Claim(ctx, "short", time.Minute); err != nil {
		t.Fatal(err)
	}
	want("Claim of a held key", read, "Commit")
	if _, err := b.Extend(ctx, res2.Claim, time.Minute); err != nil {
		t.Fatal(err)
	}
	want("Extend", read, "Commit")
	if err := b.Release(ctx, res2.Claim); err != nil {
		t.Fatal(err)
	}
	want("Release", dml, "Commit")
	if _, err := b.PurgeExpired(ctx, 0); err != nil {
		t.Fatal(err)
	}
	want("PurgeExpired with nothing expired", read)
	p, pr := newBackend(t, "", spannerlock.WithTTL(time.Millisecond))
	if _, err := p.Claim(ctx, "old", time.Millisecond); err != nil {
		t.Fatal(err)
	}
	time.Sleep(10 * time.Millisecond)
	pr.take()
	if n, err := p.PurgeExpired(ctx, 0); n != 1 || err != nil {
		t.Fatalf("PurgeExpired of one expired row: %d %v", n, err)
	}
	r = pr
	want("PurgeExpired of one expired row", read, read, "StreamingRead", "Commit")
	t.Logf("per fresh delivery: 4 RPCs (Claim %s+Commit, Complete %s+Commit)", read, read)
}

// A Claim whose commit applied but whose reply was lost finds its own
// token when it runs again, and answers Won with the fence it wrote: no
// second fence, no HeldByOther.
func TestClaimWithALostCommitReplyFindsItsOwnClaim(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	for _, path := range []string{"create", "reclaim"} {
		t.Run(path, func(t *testing.T) {
			b, r := newBackend(t, "")
			want := int64(1)
			if path == "reclaim" {
				b.Claim(ctx, "k", time.Millisecond)
				time.Sleep(5 * time.Millisecond)
				want = 2
			}
			r.take()
			r.loseNextCommit.Store(true)
			res, err := b.Claim(ctx, "k", time.Minute)
			if err != nil || res.Outcome != store.Won || res.Claim.Fence != want {
				t.Fatalf("claim after a lost commit reply: %+v %v; want won with fence %d", res, err, want)
			}
			if r.lost.Load() != 1 {
				t.Fatalf("%d replies lost, want 1", r.lost.Load())
			}
			t.Logf("RPCs: %v", r.take())
			if ok, err := b.Complete(ctx, res.Claim); !ok || err != nil {
				t.Fatalf("complete: %v %v", ok, err)
			}
		})
	}
}

// A Claim whose lost commit applied, and whose retry comes after the lease
// that commit stored lapsed and another instance took the key: when the
// Spanner client resends the Commit (after Unavailable), Spanner answers
// with the first commit's outcome and the claim is Won with fence 1, a
// lease that lapsed and a fence the newer claim outranks; when the loss
// reaches the backend (DeadlineExceeded), its own retry cannot tell
// whether it won and returns an error, never HeldByOther or AlreadyDone.
func TestClaimRetriedPastItsLeaseCannotTellAndFails(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	const lease = 50 * time.Millisecond
	for _, code := range []codes.Code{codes.Unavailable, codes.DeadlineExceeded} {
		for _, then := range []string{"held", "done"} {
			t.Run(code.String()+"/"+then, func(t *testing.T) {
				db := database(t)
				a, ra := newBackend(t, db)
				other, _ := newBackend(t, db)
				ra.lostCode = code
				ra.loseNextCommit.Store(true)
				ra.whileLost = func() {
					ra.whileLost = nil
					time.Sleep(2 * lease)
					r, err := other.Claim(ctx, "k", time.Hour)
					if err != nil || r.Outcome != store.Won || r.Claim.Fence != 2 {
						t.Errorf("the other instance's claim: %+v %v", r, err)
						return
					}
					if then == "done" {
						if ok, err := other.Complete(ctx, r.Claim); !ok || err != nil {
							t.Errorf("the other instance's complete: %v %v", ok, err)
						}
					}
				}
				res, err := a.Claim(ctx, "k", lease)
				if ra.lost.Load() != 1 {
					t.Fatalf("%d replies lost, want 1", ra.lost.Load())
				}
				if code == codes.Unavailable {
					if err != nil || res.Outcome != store.Won || res.Claim.Fence != 1 {
						t.Fatalf("claim whose Commit the client resent: %+v %v; want won with fence 1", res, err)
					}
					if ok, err := a.Complete(ctx, res.Claim); ok || err != nil {
						t.Fatalf("complete of the outranked claim: %v %v; want false", ok, err)
					}
					return
				}
				if err == nil || !strings.Contains(err.Error(), "unknown") {
					t.Fatalf("claim whose lost write won, lapsed and was taken over: %v %v; want an unknown outcome", res.Outcome, err)
				}
			})
		}
	}
}

// When the lost commit's lease cannot have lapsed by the time the retry
// reads, and the row holds our token, the retry answers Won with it.
func TestClaimRetriedByTheBackendFindsItsOwnToken(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	b, r := newBackend(t, "")
	r.lostCode = codes.DeadlineExceeded
	r.loseNextCommit.Store(true)
	res, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || res.Outcome != store.Won || res.Claim.Fence != 1 {
		t.Fatalf("claim after a lost commit reply: %+v %v; want won with fence 1", res, err)
	}
	if got := r.take(); !slices.Equal(got, []string{"ExecuteStreamingSql", "Commit", "ExecuteStreamingSql", "Commit"}) {
		t.Errorf("RPCs %v: want the backend's own second transaction", got)
	}
	if ok, err := b.Complete(ctx, res.Claim); !ok || err != nil {
		t.Fatalf("complete: %v %v", ok, err)
	}
}

// A Complete whose commit applied but whose reply was lost reports true
// when it runs again, and leaves the ttl as the first commit set it.
func TestCompleteWithALostCommitReplyIsTrue(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	b, r := newBackend(t, "")
	res, err := b.Claim(ctx, "k", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	r.loseNextCommit.Store(true)
	if ok, err := b.Complete(ctx, res.Claim); !ok || err != nil {
		t.Fatalf("complete after a lost reply: %v %v", ok, err)
	}
	if r.lost.Load() != 1 {
		t.Fatalf("%d replies lost, want 1", r.lost.Load())
	}
	// A zombie's Complete whose reply is lost: nothing matched, and the
	// retry cannot be sure, so false or an error, never true.
	stale := res.Claim
	stale.Token = store.NewToken()
	r.loseNextCommit.Store(true)
	if ok, err := b.Complete(ctx, stale); ok {
		t.Fatalf("a stale claim completed: %v", err)
	}
	if _, err := b.Extend(ctx, stale, time.Minute); !errors.Is(err, store.ErrLost) {
		t.Fatalf("extend of a stale claim: %v, want ErrLost", err)
	}
}
