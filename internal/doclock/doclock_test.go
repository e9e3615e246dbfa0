package doclock

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// memStore is a Store in memory whose replies carry the time of now (a
// service that reports its time), and that counts its requests.
type memStore struct {
	mu    sync.Mutex
	now   func() time.Time
	clock *Clock
	recs  map[string]Record
	ver   int64
	calls []string
}

func (m *memStore) Read(_ context.Context, key string) (Record, bool, Reading, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls = append(m.calls, "read")
	at := m.now()
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
	m.clock.Observe(at, at, at, false)
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
	m.clock.Observe(at, at, at, false)
	if cur, ok := m.recs[key]; !ok || cur.Version != base {
		return 0, false, at, nil, nil
	}
	m.ver++
	r.Version = m.ver
	m.recs[key] = r
	return m.ver, true, at, nil, nil
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
