package spannerlock_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
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
// renewed the lease a second time from a later instant): it returns an
// error that is not ErrLost.
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
	t.Logf("RPCs: %v", r.take())
	if err == nil || errors.Is(err, store.ErrLost) {
		t.Fatalf("Extend whose resent Commit was refused = %v, %v; want an error that is not ErrLost", ext.LeaseExpiry, err)
	}
}
