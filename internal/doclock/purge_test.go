package doclock

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// memPurge is a PurgeStore in memory: its records' expires_at by name,
// replies that carry the time of now, and a query that returns at most
// served records a call (a service that answers short, with more to come).
type memPurge struct {
	now    func() time.Time
	clock  *Clock
	exp    map[string]time.Time
	served int
	probes int
}

func (m *memPurge) Probe(context.Context) error {
	m.probes++
	at := m.now()
	m.clock.Observe(at, at, at, true)
	return nil
}

func (m *memPurge) Expired(_ context.Context, lo time.Time, limit int) ([]Expired, time.Time, bool, error) {
	at := m.now()
	m.clock.Observe(at, at, at, true)
	var found []Expired
	for name, exp := range m.exp {
		if len(found) == min(limit, m.served) {
			return found, at, false, nil
		}
		if !exp.After(lo) {
			found = append(found, Expired{Exp: exp, Ref: name})
		}
	}
	return found, at, true, nil
}

func (m *memPurge) Delete(_ context.Context, recs []Expired) (int, error) {
	for _, r := range recs {
		delete(m.exp, r.Ref.(string))
	}
	return len(recs), nil
}

// Purge reads the server's time first when it has none, deletes every
// record expired by it across short batches, keeps those that are not,
// and stops at its limit; an expires_at of time.Time{} has expired.
func TestPurgeDeletesWhatExpiredByTheServersTime(t *testing.T) {
	now := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	clock := NewClock(func() time.Time { return now })
	m := &memPurge{now: func() time.Time { return now }, clock: clock, exp: map[string]time.Time{}, served: 3}
	for i := range 10 {
		m.exp[fmt.Sprintf("old-%d", i)] = now.Add(-time.Minute)
	}
	m.exp["year-one"] = time.Time{}
	m.exp["live"] = now.Add(time.Minute)
	l := New("testlock", time.Hour, clock, &memStore{now: func() time.Time { return now }, clock: clock, recs: map[string]Record{}})
	if n, err := l.Purge(t.Context(), 4, m); n != 4 || err != nil {
		t.Fatalf("purge with limit 4: %d %v, want 4", n, err)
	}
	if m.probes != 1 {
		t.Fatalf("%d probes, want 1 (no server time yet)", m.probes)
	}
	if n, err := l.Purge(t.Context(), 0, m); n != 7 || err != nil {
		t.Fatalf("purge: %d %v, want the 7 left, across batches of 3", n, err)
	}
	if _, ok := m.exp["live"]; !ok || len(m.exp) != 1 {
		t.Fatalf("left %v, want the live record alone", m.exp)
	}
}

// Purge's errors name the backend and what failed.
func TestPurgeErrorsNameTheBackend(t *testing.T) {
	clock := NewClock(time.Now)
	l := New("testlock", time.Hour, clock, &memStore{now: time.Now, clock: clock, recs: map[string]Record{}})
	boom := errors.New("boom")
	_, err := l.Purge(t.Context(), 0, failingProbe{boom})
	if !errors.Is(err, boom) || err.Error() != "testlock: purge: reading the server's time: boom" {
		t.Fatalf("purge: %v", err)
	}
}

type failingProbe struct{ err error }

func (f failingProbe) Probe(context.Context) error { return f.err }
func (f failingProbe) Expired(context.Context, time.Time, int) ([]Expired, time.Time, bool, error) {
	return nil, time.Time{}, true, f.err
}
func (f failingProbe) Delete(context.Context, []Expired) (int, error) { return 0, f.err }

// CheckNew refuses a nil connection, a typed nil one, an empty project and
// WithClientOptions, each with the backend's name and its sentinel.
func TestCheckNew(t *testing.T) {
	var typedNil *struct{}
	for _, c := range []struct {
		conn    any
		project string
		opts    bool
		want    error
	}{{nil, "p", false, ErrNilConn}, {typedNil, "p", false, ErrNilConn}, {1, "", false, ErrNoProject}, {1, "p", true, ErrClientOptions}, {1, "p", false, nil}} {
		err := CheckNew("testlock", c.conn, c.project, c.opts)
		if !errors.Is(err, c.want) || (err == nil) != (c.want == nil) || err != nil && !strings.HasPrefix(err.Error(), "testlock: ") {
			t.Errorf("CheckNew(%v, %q, %v) = %v, want %v", c.conn, c.project, c.opts, err, c.want)
		}
	}
}
