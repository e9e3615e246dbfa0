package doclock

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A renewal of a claim waits while its transactional completion holds its
// turn (Committing), and goes ahead when it ends; a renewal of another
// claim of the same key (another fence) does not wait, and a waiting
// renewal whose context ends returns its error without writing.
func TestExtendWaitsForTheCommitOfItsClaim(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l, m := newLock(func() time.Time { return now })
	ctx := t.Context()
	r, err := l.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim: %v %v", r.Outcome, err)
	}
	c := r.Claim
	end, err := l.Committing(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	m.take()
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if _, err := l.Extend(short, c, time.Hour); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("extend while the commit holds the turn: %v, want the context's error", err)
	}
	if calls := m.take(); len(calls) != 0 {
		t.Fatalf("the waiting renewal sent %v, want nothing", calls)
	}
	other := c
	other.Fence, other.Rev = other.Fence+1, 0 // read, and found not its own
	if _, err := l.Extend(ctx, other, time.Hour); !errors.Is(err, store.ErrLost) {
		t.Fatalf("extend of another fence: %v, want ErrLost at once", err)
	}
	renewed := make(chan error, 1)
	go func() {
		_, err := l.Extend(ctx, c, time.Hour)
		renewed <- err
	}()
	select {
	case err := <-renewed:
		t.Fatalf("extend returned %v while the commit holds the turn", err)
	case <-time.After(20 * time.Millisecond):
	}
	end()
	end() // a second call is harmless
	if err := <-renewed; err != nil {
		t.Fatalf("extend after the commit's turn: %v", err)
	}
	if n := len(l.gates.m); n != 0 {
		t.Fatalf("%d gates left after every party left", n)
	}
}

// TxDone marks only a record Claimed with the claim's fence and token,
// keeping its lease, and expires it a ttl after the server's time.
func TestTxDoneMarksOnlyTheClaimsRecord(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l, _ := newLock(func() time.Time { return now })
	ctx := t.Context()
	r, err := l.Claim(ctx, "k", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	c := r.Claim
	cur := fromClaim(c, l.ttl)
	cur.Lease = cur.Lease.Add(time.Hour) // renewed
	next, held, err := l.TxDone(ctx, c, "fp", cur, true, nil)
	if err != nil || !held {
		t.Fatalf("TxDone of the claim's record: %v %v", held, err)
	}
	if next.State != StateDone || next.Fence != c.Fence || next.Token != c.Token || !next.Lease.Equal(cur.Lease) ||
		next.Fingerprint != "fp" || !next.Exp.Equal(instant(now, l.ttl)) {
		t.Fatalf("TxDone: %+v", next)
	}
	for name, rec := range map[string]Record{
		"another fence": {State: StateClaimed, Fence: c.Fence + 1, Token: c.Token},
		"another token": {State: StateClaimed, Fence: c.Fence, Token: c.Token + "x"},
		"done":          {State: StateDone, Fence: c.Fence, Token: c.Token},
	} {
		if _, held, err := l.TxDone(ctx, c, "", rec, true, nil); held || err != nil {
			t.Errorf("%s: held %v %v, want false, nil", name, held, err)
		}
	}
	if _, held, err := l.TxDone(ctx, c, "", cur, false, nil); held || err != nil {
		t.Errorf("no record: held %v %v, want false, nil", held, err)
	}
}

// TxLanded finds the record an earlier attempt's commit wrote (versions
// aside), and nothing else: not the Claimed record, not another Done one.
func TestTxLandedFindsOnlyAnEarlierAttemptsRecord(t *testing.T) {
	lease := time.Date(2026, 1, 1, 0, 1, 0, 0, time.UTC)
	sent := Record{State: StateDone, Fence: 3, Token: "t", Lease: lease, Exp: lease.Add(time.Hour), Fingerprint: "fp", Version: 7}
	landed := sent
	landed.Version = 9
	if !TxLanded(landed, true, []Record{sent}) {
		t.Error("the record an earlier attempt committed: not found")
	}
	claimed := sent
	claimed.State = StateClaimed
	otherExp := sent
	otherExp.Exp = otherExp.Exp.Add(time.Second) // another completion of the same claim
	for name, cur := range map[string]Record{"claimed": claimed, "done by another completion": otherExp} {
		if TxLanded(cur, true, []Record{sent}) {
			t.Errorf("%s: found landed", name)
		}
	}
	if TxLanded(landed, false, []Record{sent}) || TxLanded(landed, true, nil) {
		t.Error("landed with no record, or with no earlier commit")
	}
}
