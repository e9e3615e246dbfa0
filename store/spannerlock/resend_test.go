package spannerlock_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
)

// A Claim whose Commit applied but whose reply was lost (Unavailable),
// when a newer transaction of the same client has begun before the
// Spanner client resends the Commit: the emulator refuses the resent one
// (FailedPrecondition or NotFound naming the transaction) though the
// first applied. When the claim's lease lapsed meanwhile and another call
// took the key over (and completed it), the Claim cannot tell whether it
// won and fails, never HeldByOther or AlreadyDone (on main it answered
// those, as the history check found); when nobody took the key, it finds
// its own claim and answers Won with the fence it wrote.
func TestClaimWhoseResentCommitIsRefused(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	const lease = 50 * time.Millisecond
	for _, then := range []string{"held", "done", "untouched"} {
		t.Run(then, func(t *testing.T) {
			b, r := newBackend(t, "")
			r.loseNextCommit.Store(true)
			r.whileLost = func() {
				r.whileLost = nil
				if then == "untouched" {
					// A newer transaction of the same client, on another key.
					if _, err := b.Claim(ctx, "elsewhere", time.Hour); err != nil {
						t.Errorf("claim of another key: %v", err)
					}
					return
				}
				time.Sleep(2 * lease)
				o, err := b.Claim(ctx, "k", time.Hour)
				if err != nil || o.Outcome != store.Won || o.Claim.Fence != 2 {
					t.Errorf("the other call's claim: %+v %v; want won with fence 2", o, err)
					return
				}
				if then == "done" {
					if ok, err := b.Complete(ctx, o.Claim); !ok || err != nil {
						t.Errorf("the other call's complete: %v %v", ok, err)
					}
				}
			}
			res, err := b.Claim(ctx, "k", lease)
			if r.lost.Load() != 1 {
				t.Fatalf("%d replies lost, want 1", r.lost.Load())
			}
			t.Logf("RPCs: %v", r.take())
			if then == "untouched" {
				if err != nil || res.Outcome != store.Won || res.Claim.Fence != 1 {
					t.Fatalf("claim whose resent Commit was refused, key untouched: %+v %v; want won with fence 1", res, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), "unknown") {
				t.Fatalf("claim whose lost write won, lapsed and was taken over: %v %v; want an unknown outcome", res.Outcome, err)
			}
		})
	}
}

// An Extend whose Commit applied but whose reply was lost, and whose
// resent Commit the emulator refuses because a newer transaction of the
// same client began meanwhile, is not run again (on main it was, and
// renewed the lease a second time from a later instant): a strong read
// finds the lease the first Commit stored, and Extend returns it.
func TestExtendWhoseResentCommitIsRefusedIsNotRunAgain(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	b, r := newBackend(t, "")
	res, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || res.Outcome != store.Won {
		t.Fatalf("claim: %+v %v", res, err)
	}
	r.take()
	r.loseNextCommit.Store(true)
	r.whileLost = func() {
		r.whileLost = nil
		if _, err := b.Claim(ctx, "elsewhere", time.Hour); err != nil {
			t.Errorf("claim of another key: %v", err)
		}
	}
	ext, err := b.Extend(ctx, res.Claim, time.Hour)
	if r.lost.Load() != 1 {
		t.Fatalf("%d replies lost, want 1", r.lost.Load())
	}
	rpcs := r.take()
	t.Logf("RPCs: %v", rpcs)
	// The Extend's statement and Commit, the other Claim's, the resent
	// Commit, and the strong read: the statement ran once.
	want := []string{"ExecuteStreamingSql", "Commit", "ExecuteStreamingSql", "Commit", "Commit", "ExecuteStreamingSql"}
	if !slices.Equal(rpcs, want) {
		t.Errorf("RPCs %v, want %v", rpcs, want)
	}
	if err != nil {
		t.Fatalf("Extend whose resent Commit was refused: %v; want the lease the first Commit stored", err)
	}
	rec, ok, err := b.Inspect(ctx, "k")
	if err != nil || !ok || !rec.LeaseExpiry.Equal(ext.LeaseExpiry) {
		t.Fatalf("stored lease %v (%v %v), Extend reported %v", rec.LeaseExpiry, ok, err, ext.LeaseExpiry)
	}
}

// notFound is how the emulator answers a Commit of a transaction that a
// concurrent one made it forget (no reply lost: nothing applied).
var notFound = refusal{method: "Commit", code: codes.NotFound, msg: "Transaction not found: 7"}

// won claims key on b for a minute, and fails the test unless it won.
func won(t *testing.T, b *spannerlock.Backend, key string) store.Result {
	t.Helper()
	res, err := b.Claim(t.Context(), key, time.Minute)
	if err != nil || res.Outcome != store.Won {
		t.Fatalf("claim %q: %+v %v", key, res, err)
	}
	return res
}

// A Complete whose Commit the emulator answers NotFound (its transaction
// forgotten, nothing applied, no reply lost), after which the claim is
// released, answers false: a strong read right after the answer found
// the row not completed, before the expires-at instant the write would
// have stored. On main it answered "the outcome is unknown".
func TestCompleteWhoseTransactionTheEmulatorForgotIsFalseNotUnknown(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	b, r := newBackend(t, "")
	res := won(t, b, "k")
	f := notFound
	f.meanwhile = func() {
		if err := b.Release(ctx, res.Claim); err != nil {
			t.Errorf("release: %v", err)
		}
	}
	r.refuse.Store(&f)
	ok, err := b.Complete(ctx, res.Claim)
	if r.refused.Load() != 1 {
		t.Fatalf("%d Commits refused, want 1", r.refused.Load())
	}
	if ok || err != nil {
		t.Fatalf("Complete whose transaction was forgotten, claim released meanwhile = %v, %v; want false, nil", ok, err)
	}
	// And once it is forgotten with the claim still held, the next run
	// completes it.
	res = won(t, b, "k2")
	f = notFound
	r.refuse.Store(&f)
	if ok, err := b.Complete(ctx, res.Claim); !ok || err != nil {
		t.Fatalf("Complete whose first transaction was forgotten = %v, %v; want true, nil", ok, err)
	}
}

// An Extend whose Commit the emulator answers NotFound (nothing applied,
// no reply lost) runs again and renews the lease: a strong read found
// the row without the lease the statement returned. On main it returned
// "the extension may have been applied; not run again".
func TestExtendWhoseTransactionTheEmulatorForgotRunsAgain(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	b, r := newBackend(t, "")
	res := won(t, b, "k")
	f := notFound
	r.refuse.Store(&f)
	ext, err := b.Extend(ctx, res.Claim, time.Hour)
	if r.refused.Load() != 1 {
		t.Fatalf("%d Commits refused, want 1", r.refused.Load())
	}
	if err != nil {
		t.Fatalf("Extend whose transaction was forgotten: %v; want it run again", err)
	}
	rec, ok, err := b.Inspect(ctx, "k")
	if err != nil || !ok || !rec.LeaseExpiry.Equal(ext.LeaseExpiry) || !ext.LeaseExpiry.After(res.Claim.LeaseExpiry.Add(50*time.Minute)) {
		t.Fatalf("stored lease %v (%v %v), Extend reported %v, claimed %v", rec.LeaseExpiry, ok, err, ext.LeaseExpiry, res.Claim.LeaseExpiry)
	}
}
