package pgxlock_test

import (
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/pgxlock"
)

// refuseFirst forwards TCP connections to target, except the first n,
// which it closes at once, before the server has said anything: a
// connection that was never made (a server restarting, a full listen
// queue). It returns its host:port.
func refuseFirst(t *testing.T, target string, n int32) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var seen atomic.Int32
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if seen.Add(1) <= n {
				c.Close()
				continue
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			go func() { io.Copy(s, c); s.Close() }()
			go func() { io.Copy(c, s); c.Close() }()
		}
	}()
	return ln.Addr().String()
}

// A connection that could not be made sent no statement: the retry after
// it answers the claim's true outcome (HeldByOther, AlreadyDone), not an
// "outcome unknown" error, and a Complete's retry that finds the claim
// fenced out answers false.
func TestAConnectionNeverMadeDoesNotMakeTheOutcomeUnknown(t *testing.T) {
	dsn := testsvc.Postgres(t)
	host := hostOf(dsn)
	ctx := t.Context()
	direct, table := newBackend(t, openPool(t, dsn))
	won(t, direct, "held")
	done := won(t, direct, "done")
	if ok, err := direct.Complete(ctx, done); !ok || err != nil {
		t.Fatal(ok, err)
	}
	stale := won(t, direct, "stale")
	if err := direct.Release(ctx, stale); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		key  string
		want store.Outcome
	}{{"held", store.HeldByOther}, {"done", store.AlreadyDone}} {
		b := backendOn(t, strings.Replace(dsn, host, refuseFirst(t, host, 1), 1), table)
		res, err := b.Claim(ctx, tc.key, time.Minute)
		if err != nil || res.Outcome != tc.want {
			t.Errorf("Claim(%q) after a refused connection = %v, %v; want %v", tc.key, res.Outcome, err, tc.want)
		}
	}
	b := backendOn(t, strings.Replace(dsn, host, refuseFirst(t, host, 1), 1), table)
	if ok, err := b.Complete(ctx, stale); ok || err != nil {
		t.Errorf("Complete of a released claim after a refused connection = %v, %v; want false, nil", ok, err)
	}
}

// backendOn is a backend on table through a pool of its own on dsn.
func backendOn(t *testing.T, dsn, table string) *pgxlock.Backend {
	t.Helper()
	b, err := pgxlock.New(openPool(t, dsn), pgxlock.WithTable(table))
	if err != nil {
		t.Fatal(err)
	}
	return b
}
