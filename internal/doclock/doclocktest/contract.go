package doclocktest

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// Tuning is what a driver's contract runs may set apart, for its
// emulator's speed.
type Tuning struct {
	// ServerClockHistoryOps are the history case's calls in
	// ContractServerClock, client ahead and client behind (0: the full
	// 10,000).
	ServerClockHistoryOps [2]int
	// RealClock runs ContractRealClock, the suite in real time.
	RealClock bool
}

// contractOnClock is the backend of a contract case that judges time by
// clock, reached through a DropProxy, with its faults.
func (d h) contractOnClock(t *testing.T, clock *fake.Clock, c Config) (Backend, storetest.Faults) {
	c.Clock = clock.Now
	if d.StampsTime() && c.Server == nil {
		c.Server = clock.Now
	}
	return d.Contract(t, c)
}

// withTTL is the suite's Harness.WithTTL: a backend built as c says, with
// the given ttl (its records apart from the case's backend's).
func (d h) withTTL(t *testing.T, c Config) func(time.Duration) store.Backend {
	return func(ttl time.Duration) store.Backend {
		c.TTL = ttl
		b, _ := d.New(t, c)
		return b
	}
}

// jumpHarness is the contract suite's backend on a server clock that jumps
// (storetest.JumpHarness): its replies carry the server's time, and its own
// clock reads that minus every jump, so what it estimated of the server's
// time before a jump stays where it was.
func (d h) jumpHarness(t *testing.T) storetest.JumpHarness {
	server := NewClock()
	var jumped atomic.Int64
	client := func() time.Time { return server.Now().Add(-time.Duration(jumped.Load())) }
	b, f := d.Contract(t, Config{Server: server.Now, Clock: client})
	return storetest.JumpHarness{
		Harness: storetest.Harness{Backend: b, TTL: b.TTL(), Advance: server.Advance, Now: server.Now, Faults: f},
		Jump: func(d time.Duration) {
			jumped.Add(int64(d))
			server.Advance(d)
		},
	}
}

// RunContract runs storetest's suites on d: the contract (store.Run) and
// the operations (store.RunOps), on a fake clock and with the backend's
// own clock hours off the server's, and, when tuning says, the contract in
// real time.
func RunContract(t *testing.T, d Driver, tuning Tuning) {
	drv := h{d}
	drv.Emulator(t)
	t.Run("Contract", func(t *testing.T) {
		storetest.Run(t, func(t *testing.T) storetest.Harness {
			clock := NewClock()
			b, f := drv.contractOnClock(t, clock, Config{})
			c := Config{Clock: clock.Now}
			if drv.StampsTime() {
				c.Server = clock.Now
			}
			return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: clock.Advance, Now: clock.Now, Faults: f,
				WithTTL: drv.withTTL(t, c), ServerClock: drv.jumpHarness}
		})
	})
	if tuning.RealClock {
		// The same suite on the system clock, waiting in real time. The
		// ttl is generous: the emulator is a JVM, and on a loaded machine
		// one call can take a second.
		t.Run("ContractRealClock", func(t *testing.T) {
			const ttl = 5 * time.Second
			storetest.Run(t, func(t *testing.T) storetest.Harness {
				b, f := drv.Contract(t, Config{TTL: ttl})
				// The history case runs its 10,000 calls in Contract; in
				// real time, fewer.
				return storetest.Harness{Backend: b, TTL: ttl, Step: ttl / 10, Faults: f, HistoryOps: 3000, WithTTL: drv.withTTL(t, Config{})}
			})
		})
	}
	// The suite again, with replies that carry the server's time (as the
	// production service's do) while the backend's own clock is hours off.
	t.Run("ContractServerClock", func(t *testing.T) {
		for i, off := range []time.Duration{Skew, -Skew} {
			t.Run(map[bool]string{true: "client_ahead", false: "client_behind"}[off > 0], func(t *testing.T) {
				storetest.Run(t, func(t *testing.T) storetest.Harness {
					server := NewClock()
					c := Config{Server: server.Now, Clock: Skewed(server, off)}
					b, f := drv.Contract(t, c)
					return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: server.Advance, Now: server.Now, Faults: f,
						HistoryOps: tuning.ServerClockHistoryOps[i], WithTTL: drv.withTTL(t, c)}
				})
			})
		}
	})
	// The operations (store.Operator) by the rules of storetest.RunOps.
	t.Run("Ops", func(t *testing.T) {
		storetest.RunOps(t, func(t *testing.T) storetest.Harness {
			clock := NewClock()
			b, f := drv.contractOnClock(t, clock, Config{})
			return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: clock.Advance, Now: clock.Now, Faults: f}
		})
	})
	// The operations again with the backend's own clock hours off the
	// server's: Inspect and List report the server's time, and
	// ForceRelease ends the lease by it.
	t.Run("OpsServerClock", func(t *testing.T) {
		for _, off := range []time.Duration{Skew, -Skew} {
			t.Run(map[bool]string{true: "client_ahead", false: "client_behind"}[off > 0], func(t *testing.T) {
				storetest.RunOps(t, func(t *testing.T) storetest.Harness {
					server := NewClock()
					b, f := drv.Contract(t, Config{Server: server.Now, Clock: Skewed(server, off)})
					return storetest.Harness{Backend: b, TTL: b.TTL(), Advance: server.Advance, Now: server.Now, Faults: f}
				})
			})
		}
	})
}

// RunContractTx runs storetest's suite of store.TxCompleter on d, on a
// fake clock, with lost replies and cut connections.
func RunContractTx[Tx any](t *testing.T, d TxDriver[Tx]) {
	drv := h{d}
	storetest.RunTx(t, func(t *testing.T) storetest.TxHarness[Tx] {
		clock := NewClock()
		b, f := drv.contractOnClock(t, clock, Config{})
		s := d.Sink(t)
		return storetest.TxHarness[Tx]{
			Harness: storetest.Harness{Backend: b, TTL: b.TTL(), Advance: clock.Advance, Now: clock.Now, Faults: f},
			Write:   func(ctx context.Context, tx Tx, id string) error { return s.Write(tx, id) },
			Count:   s.Count,
			Retry:   s.Retry,
			Read:    s.Read,
			EndTx:   s.EndTx,
		}
	})
}
