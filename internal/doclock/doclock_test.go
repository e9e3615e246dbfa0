package doclock

import (
	"context"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// memStore is a Store in memory whose replies carry the time of now (a
// service that reports its time), and that counts its requests.
type memStore struct {
	mu      sync.Mutex
	now     func() time.Time
	clock   *Clock
	observe func(at time.Time) // when set, replaces clock.Observe for writes
	recs    map[string]Record
	ver     int64
	calls   []string
}

func (m *memStore) Read(_ context.Context, key string) (Record, bool, Reading, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls = append(m.calls, "read")
	at := m.now()
	if m.observe != nil {
		m.observe(at)
		rd := Reading{At: at, Recv: m.clock.Now(), Exact: true}
		r, ok := m.recs[key]
		return r, ok, rd, nil
	}
	m.clock.Observe(at, at, at, true)
	rd, err := m.clock.Judge(at, at)
	r, ok := m.recs[key]
	return r, ok, rd, err
}

func (m *memStore) Create(_ context.Context, key string, r Record) (int64, time.Time, error, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls = append(m.calls, "create")
	at := m.now()
	m.observeWrite(at)
	if _, ok := m.recs[key]; ok {
		return 0, at, nil, ErrExists
	}
	m.ver++
	r.Version = m.ver
	m.recs[key] = r
	return m.ver, at, nil, nil
}

func (m *memStore) Update(_ context.Context, key string, r Record, base int64) (int64, bool, time.Time, error, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls = append(m.calls, "update")
	at := m.now()
	m.observeWrite(at)
	if cur, ok := m.recs[key]; !ok || cur.Version != base {
		return 0, false, at, nil, nil
	}
	m.ver++
	r.Version = m.ver
	m.recs[key] = r
	return m.ver, true, at, nil, nil
}

func (m *memStore) observeWrite(at time.Time) {
	if m.observe != nil {
		m.observe(at)
		return
	}
	m.clock.Observe(at, at, at, false)
}

func (m *memStore) take() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	c := m.calls
	m.calls = nil
	return c
}

func newLock(now func() time.Time) (*Lock, *memStore) {
	c := NewClock(now)
	m := &memStore{now: now, clock: c, recs: map[string]Record{}}
	return New("test", time.Hour, c, m), m
}

// The fingerprint a completion stores is reported for the Done key, kept
// by a second completion of the same claim, and dropped by a reclaim.
func TestFingerprintLivesAsLongAsTheDoneRecord(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l, _ := newLock(func() time.Time { return now })
	ctx := t.Context()
	r, err := l.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim: %v %v", r.Outcome, err)
	}
	if ok, err := l.CompleteFingerprint(ctx, r.Claim, "one"); !ok || err != nil {
		t.Fatalf("complete: %v %v", ok, err)
	}
	if ok, err := l.CompleteFingerprint(ctx, r.Claim, "two"); !ok || err != nil {
		t.Fatalf("second complete: %v %v", ok, err)
	}
	if d, _ := l.Claim(ctx, "k", time.Minute); d.Outcome != store.AlreadyDone || d.Fingerprint != "one" {
		t.Fatalf("done key: %v %q, want already done with one", d.Outcome, d.Fingerprint)
	}
	now = now.Add(2 * time.Hour)
	again, _ := l.Claim(ctx, "k", time.Minute)
	if again.Outcome != store.Won || again.Claim.Fence != 2 {
		t.Fatalf("reclaim: %v fence %d", again.Outcome, again.Claim.Fence)
	}
	if ok, _ := l.Complete(ctx, again.Claim); !ok {
		t.Fatal("complete after the reclaim")
	}
	if d, _ := l.Claim(ctx, "k", time.Minute); d.Outcome != store.AlreadyDone || d.Fingerprint != "" {
		t.Fatalf("after a reclaim completed without one: %v %q", d.Outcome, d.Fingerprint)
	}
}

// A write bases its instants on the estimate only while the estimate's
// bounds lie within maxUncertainty: after a reply that took longer (or
// crossed a jump of the clock), the call reads first and writes from the
// read's time.
func TestAWideEstimateMakesTheCallReadFirst(t *testing.T) {
	server := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l, m := newLock(func() time.Time { return server })
	ctx := t.Context()
	r, _ := l.Claim(ctx, "k", time.Minute)
	m.take()
	// A reply stamped a minute after its request was sent, alone in the
	// last minute.
	sent := server.Add(2 * time.Minute)
	server = sent.Add(time.Minute)
	l.clock.Observe(server, sent, server, true)
	if lo, hi, ok := l.clock.Times(); !ok || hi.Sub(lo) != time.Minute {
		t.Fatalf("bounds %v..%v %v, want a minute apart", lo, hi, ok)
	}
	if ok, err := l.Complete(ctx, r.Claim); !ok || err != nil {
		t.Fatalf("complete: %v %v", ok, err)
	}
	if calls := m.take(); len(calls) != 2 || calls[0] != "read" {
		t.Fatalf("calls %v, want a read before the update", calls)
	}
	if got, want := m.recs["k"].Exp, server.Add(time.Hour); !got.Equal(want) {
		t.Fatalf("done until %v, want %v (a ttl from the server's now, not from the upper bound a minute ahead)", got, want)
	}
}

// stepStore is a memStore whose server clock runs apart from the client's:
// server() is the time its replies carry, client() what the Lock reads.
func newSteppedLocks(client, server func() time.Time) (a, b *Lock, m *memStore) {
	m = &memStore{now: server, recs: map[string]Record{}}
	ca, cb := NewClock(client), NewClock(client)
	m.observe = func(at time.Time) {
		ca.Observe(at, client(), client(), false)
		cb.Observe(at, client(), client(), false)
	}
	m.clock = ca
	return New("test", time.Hour, ca, m), New("test", time.Hour, cb, m), m
}

// After the server's clock steps ahead of the client's estimate by more
// than a lease (and by more than the ttl), with the client's clock left
// still: a claim written from the stale estimate must not hand out a lease
// that lapsed as it was written (two holders), and a completion must not
// write a Done record that expired as it was written (the body run again
// within the ttl). Both failed on 72b2726: the estimate's bounds crossed
// (a negative gap passed the 100ms rule) and a write that landed well
// after its base was trusted.
func TestAServerClockThatSteppedAheadIsNotWrittenFrom(t *testing.T) {
	client := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	server := client
	a, b, _ := newSteppedLocks(func() time.Time { return client }, func() time.Time { return server })
	ctx := t.Context()
	warm, err := a.Claim(ctx, "warm", time.Minute)
	if err != nil || warm.Outcome != store.Won {
		t.Fatalf("warm-up claim: %v %v", warm.Outcome, err)
	}
	done, err := a.Claim(ctx, "done", time.Minute)
	if err != nil || done.Outcome != store.Won {
		t.Fatalf("claim: %v %v", done.Outcome, err)
	}
	server = server.Add(2 * time.Hour) // the client's clock stands still

	fresh, err := a.Claim(ctx, "fresh", time.Minute)
	if err != nil || fresh.Outcome != store.Won {
		t.Fatalf("claim after the step: %v %v", fresh.Outcome, err)
	}
	if !fresh.Claim.LeaseExpiry.After(server) {
		t.Errorf("claim after the step reports a lease to %v, already lapsed at the server's %v", fresh.Claim.LeaseExpiry, server)
	}
	if r, err := b.Claim(ctx, "fresh", time.Minute); err != nil || r.Outcome != store.HeldByOther {
		t.Errorf("second caller on a key claimed after the step: %v fence %d %v, want held by other", r.Outcome, r.Claim.Fence, err)
	}

	if ok, err := a.Complete(ctx, done.Claim); !ok || err != nil {
		t.Fatalf("complete after the step: %v %v", ok, err)
	}
	if r, err := b.Claim(ctx, "done", time.Minute); err != nil || r.Outcome != store.AlreadyDone {
		t.Errorf("second caller on a key completed after the step: %v fence %d %v, want already done", r.Outcome, r.Claim.Fence, err)
	}
}

// The same after the server's clock steps back: an estimate from before
// the step runs ahead, and the claim it writes is reported as unknown or
// written from the server's time, never with instants the server has not
// reached by a margin the caller cannot see.
func TestAServerClockThatSteppedBackIsNotWrittenFrom(t *testing.T) {
	client := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	server := client
	a, b, _ := newSteppedLocks(func() time.Time { return client }, func() time.Time { return server })
	ctx := t.Context()
	if r, err := a.Claim(ctx, "warm", time.Minute); err != nil || r.Outcome != store.Won {
		t.Fatalf("warm-up claim: %v %v", r.Outcome, err)
	}
	server = server.Add(-2 * time.Hour)
	r, err := a.Claim(ctx, "k", time.Minute)
	if err == nil {
		if r.Outcome != store.Won || r.Claim.LeaseExpiry.After(server.Add(time.Minute+estimateSlack)) {
			t.Fatalf("claim after the step back: %v lease to %v, want an error or a lease from the server's %v", r.Outcome, r.Claim.LeaseExpiry, server)
		}
	}
	// Whatever the first call answered, the clock now follows the server:
	// the next claim is written from the server's time.
	r, err = a.Claim(ctx, "k2", time.Minute)
	if err != nil || r.Outcome != store.Won || !r.Claim.LeaseExpiry.Equal(server.Add(time.Minute)) {
		t.Fatalf("next claim: %v lease to %v %v, want won to %v", r.Outcome, r.Claim.LeaseExpiry, err, server.Add(time.Minute))
	}
	if r, err := b.Claim(ctx, "k2", time.Minute); err != nil || r.Outcome != store.HeldByOther {
		t.Errorf("second caller: %v %v, want held by other", r.Outcome, err)
	}
}

// Bounds that cross (a reply put the server's time past the upper bound
// an older reply set) are never a base for a write.
func TestCrossedBoundsAreNotAnEstimate(t *testing.T) {
	client := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	c := NewClock(func() time.Time { return client })
	c.Observe(client, client, client, true)
	c.Observe(client.Add(2*time.Hour), client, client, true)
	hi, ok := c.estimate()
	if ok && hi.Before(client.Add(2*time.Hour)) {
		t.Fatalf("estimate %v after a reply at +2h, want none or one at +2h", hi)
	}
	lo, hi2, ok := c.Times()
	if ok && hi2.Before(lo) {
		t.Fatalf("bounds %v..%v cross", lo, hi2)
	}
}

// A lease, an extension or a ttl near math.MaxInt64 keeps the key held or
// done: on 72b2726 WholeMicros wrapped them into the past (a lease expiry
// in 1734) and a second caller won the key at once.
func TestDurationsAtTheirLimitKeepTheKey(t *testing.T) {
	for _, d := range []time.Duration{math.MaxInt64, math.MaxInt64 - 500, 250 * 365 * 24 * time.Hour} {
		now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
		l, m := newLock(func() time.Time { return now })
		ctx := t.Context()
		r, err := l.Claim(ctx, "k", d)
		if err != nil || r.Outcome != store.Won {
			t.Fatalf("lease %v: claim %v %v", d, r.Outcome, err)
		}
		if again, err := l.Claim(ctx, "k", time.Minute); err != nil || again.Outcome != store.HeldByOther {
			t.Errorf("lease %v: second claim %v %v, want held by other", d, again.Outcome, err)
		}
		x, err := l.Claim(ctx, "x", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := l.Extend(ctx, x.Claim, d); err != nil {
			t.Fatalf("extend by %v: %v", d, err)
		}
		now = now.Add(time.Hour)
		if again, err := l.Claim(ctx, "x", time.Minute); err != nil || again.Outcome != store.HeldByOther {
			t.Errorf("extended by %v: second claim %v %v, want held by other", d, again.Outcome, err)
		}

		long := New("test", d, l.clock, m)
		c, err := long.Claim(ctx, "done", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if ok, err := long.Complete(ctx, c.Claim); !ok || err != nil {
			t.Fatalf("ttl %v: complete %v %v", d, ok, err)
		}
		now = now.Add(24 * time.Hour)
		if again, err := long.Claim(ctx, "done", time.Minute); err != nil || again.Outcome != store.AlreadyDone {
			t.Errorf("ttl %v: claim a day after completion %v %v, want already done", d, again.Outcome, err)
		}
	}
}
