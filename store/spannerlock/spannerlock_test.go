package spannerlock_test

import (
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// The contract suite on the emulator, in real time: Spanner's clock judges
// every lease, so the suite waits instead of moving a clock. The harness
// has no ServerClock, so the cases about a server clock that jumps skip:
// started under libfaketime, emulator_main did not follow the jumps (after
// a jump of 2h ahead, a claim still reported a lease from this machine's
// time; after the clock was set back to this machine's, the next claim
// reported one from two hours behind it), and the emulator has no other
// way to move its clock. spannerlock reads no clock of the client's: every
// instant is CURRENT_TIMESTAMP() or a commit timestamp. Each case has
// a database of its own (the emulator runs one read-write transaction at
// a time per database); the history case, whose 150 clients would queue
// on one database, has historyShards, each key always on the same one.
func TestContract(t *testing.T) {
	testsvc.Spanner(t)
	const ttl = 10 * time.Second
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		if strings.HasSuffix(t.Name(), "/"+historyCase) {
			b, f := shardedBackend(t, historyShards, spannerlock.WithTTL(ttl))
			return storetest.Harness{Backend: b, TTL: ttl, Step: ttl / 10, Faults: f, HistoryOps: historyOps}
		}
		p := testsvc.NewDropProxy(t, testsvc.Spanner(t))
		r := &rpcs{}
		c := newClient(t, database(t), p.Addr(), r)
		// Backends with other ttls share the client, and so the
		// database and its table.
		withTTL := func(ttl time.Duration) store.Backend {
			b, err := spannerlock.New(c, spannerlock.WithTTL(ttl))
			if err != nil {
				t.Fatal(err)
			}
			return b
		}
		return storetest.Harness{Backend: withTTL(ttl), TTL: ttl, Step: ttl / 10, Faults: faults{r: r, p: p}, HistoryOps: historyOps, WithTTL: withTTL}
	})
}

// The operations suite (store.Operator) on the emulator, in real time, as
// TestContract: each case has a database of its own, reached through a
// DropProxy by a client that can lose a Commit's reply.
func TestOps(t *testing.T) {
	testsvc.Spanner(t)
	const ttl = 10 * time.Second
	storetest.RunOps(t, func(t *testing.T) storetest.Harness {
		p := testsvc.NewDropProxy(t, testsvc.Spanner(t))
		r := &rpcs{}
		b, err := spannerlock.New(newClient(t, database(t), p.Addr(), r), spannerlock.WithTTL(ttl))
		if err != nil {
			t.Fatal(err)
		}
		return storetest.Harness{Backend: b, TTL: ttl, Step: ttl / 10, Faults: faults{r: r, p: p}}
	})
}

const (
	// historyCase is the name of the suite's history case.
	historyCase = "concurrent_histories_are_linearizable_with_leases_that_lapse"
	// historyShards is how many databases the history case spreads its
	// keys over.
	historyShards = 16
	// historyOps is how many calls the history case makes: its full
	// 10,000 take over ten minutes on the emulator.
	historyOps = 1000
)
