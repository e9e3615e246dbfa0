package spannerlock_test

import (
	"errors"
	"slices"
	"testing"
	"time"

	"cloud.google.com/go/spanner"
	"google.golang.org/grpc/codes"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
)

// An Extend whose Commit may have applied although its reply never came
// back (an error the Spanner client does not resend on, here
// DeadlineExceeded) is not run again: a second transaction would renew
// the lease once more, from a later instant, so one call would take
// effect twice. It returns an error that is not ErrLost. A run that
// certainly applied nothing (its statement refused before it was sent) is
// still run again within WithRetries.
func TestExtendIsNotRunAgainAfterACommitThatMayHaveApplied(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	b, r := newBackend(t, "", spannerlock.WithRetries(3))
	res, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || res.Outcome != store.Won {
		t.Fatalf("claim: %+v %v", res, err)
	}

	r.take()
	r.lostCode = codes.DeadlineExceeded
	r.loseNextCommit.Store(true)
	_, err = b.Extend(ctx, res.Claim, time.Hour)
	if err == nil || errors.Is(err, store.ErrLost) {
		t.Errorf("Extend after a lost Commit reply = %v, want an error that is not ErrLost", err)
	}
	if spanner.ErrCode(err) != codes.DeadlineExceeded {
		t.Errorf("%v does not carry the lost reply's code", err)
	}
	if got := r.take(); !slices.Equal(got, []string{"ExecuteStreamingSql", "Commit"}) {
		t.Errorf("Extend after a lost Commit reply sent %v, want one statement and one Commit", got)
	}

	// Runs that certainly applied nothing are run again, and the
	// extension lands once: a statement refused before it was sent (the
	// Spanner client begins the transaction explicitly and sends it
	// again), a Commit refused before it was sent with Aborted (the
	// client runs the transaction again).
	for _, c := range []struct {
		refuse refusal
		want   []string
	}{
		{refusal{method: "ExecuteStreamingSql", code: codes.ResourceExhausted}, []string{"ExecuteStreamingSql", "BeginTransaction", "ExecuteStreamingSql", "Commit"}},
		{refusal{method: "Commit", code: codes.Aborted}, []string{"ExecuteStreamingSql", "Commit", "ExecuteStreamingSql", "Commit"}},
	} {
		before := r.refused.Load()
		r.refuse.Store(&c.refuse)
		got, err := b.Extend(ctx, res.Claim, time.Hour)
		if err != nil {
			t.Fatalf("Extend after a refused %s: %v", c.refuse.method, err)
		}
		if r.refused.Load() != before+1 {
			t.Fatalf("the %s was not refused", c.refuse.method)
		}
		if sent := r.take(); !slices.Equal(sent, c.want) {
			t.Errorf("Extend after a refused %s sent %v, want %v", c.refuse.method, sent, c.want)
		}
		if !got.LeaseExpiry.After(res.Claim.LeaseExpiry) {
			t.Errorf("the extended lease %v is not after the claimed one %v", got.LeaseExpiry, res.Claim.LeaseExpiry)
		}
	}
}

// row reads key's fence, state and expires_at with c.
func readRow(t *testing.T, c *spanner.Client, key string) (fence, state int64, exp time.Time) {
	t.Helper()
	r, err := c.Single().ReadRow(t.Context(), spannerlock.DefaultTable, spanner.Key{[]byte(key)}, []string{"fence", "state", "expires_at"})
	if err != nil {
		t.Fatalf("reading %q: %v", key, err)
	}
	if err := r.Columns(&fence, &state, &exp); err != nil {
		t.Fatal(err)
	}
	return fence, state, exp
}

// Complete and Release, run again by the backend after a Commit whose
// reply was lost (DeadlineExceeded reaches the backend), take effect
// once: the second Complete matches the Done row and keeps its
// expires_at; the second Release matches nothing, so the fence rose by
// one, not two.
func TestCompleteAndReleaseRunAgainAfterALostCommitTakeEffectOnce(t *testing.T) {
	testsvc.Spanner(t)
	ctx := t.Context()
	db := database(t)
	b, r := newBackend(t, db)
	look := newClient(t, db, testsvc.Spanner(t), &rpcs{})
	r.lostCode = codes.DeadlineExceeded

	res, err := b.Claim(ctx, "done", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	var exp time.Time
	r.whileLost = func() { _, _, exp = readRow(t, look, "done") }
	r.loseNextCommit.Store(true)
	if ok, err := b.Complete(ctx, res.Claim); !ok || err != nil {
		t.Fatalf("Complete after a lost reply: %v %v", ok, err)
	}
	if got := r.take(); r.lost.Load() != 1 || len(got) != 6 {
		t.Fatalf("%d replies lost, RPCs %v: want the claim's 2 and two runs of Complete", r.lost.Load(), got)
	}
	fence, state, exp2 := readRow(t, look, "done")
	if fence != 1 || state != 2 || !exp2.Equal(exp) {
		t.Errorf("after Complete ran twice: fence %d state %d expires_at %v; want 1, 2, %v (the first run's)", fence, state, exp2, exp)
	}

	res, err = b.Claim(ctx, "released", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	r.whileLost = nil
	r.loseNextCommit.Store(true)
	if err := b.Release(ctx, res.Claim); err != nil {
		t.Fatalf("Release after a lost reply: %v", err)
	}
	if got := r.take(); r.lost.Load() != 2 || len(got) != 6 {
		t.Fatalf("%d replies lost, RPCs %v: want the claim's 2 and two runs of Release", r.lost.Load(), got)
	}
	if fence, state, _ := readRow(t, look, "released"); fence != 2 || state != 1 {
		t.Errorf("after Release ran twice: fence %d state %d; want 2, 1", fence, state)
	}
}
