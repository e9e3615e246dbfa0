package spannerlock_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// The history check with every key in ONE database, leases of 50 to
// 200ms, and lost replies: before one call in ten, either the proxy
// between client and emulator loses the server's next reply chunk (and
// cuts that connection, failing every call in flight on it) or the
// client loses the next Commit's reply after the emulator applied it.
// The emulator runs the eight clients' transactions one at a time and
// aborts or forgets the others, so Claims run for up to seconds through
// aborts and resent Commits before they answer, long enough for the
// lease a lost commit stored to lapse and for another client to take the
// key over. (The emulator answers a Commit that the Spanner client
// resent after a lost reply with NotFound or FailedPrecondition naming
// the transaction once a newer transaction has begun, though the first
// Commit applied.)
func TestHistoryOneDatabaseWithLostReplies(t *testing.T) {
	testsvc.Spanner(t)
	const (
		step = 50 * time.Millisecond // leases of 50, 100 and 200ms
		ttl  = 20 * step
	)
	p := testsvc.NewDropProxy(t, testsvc.Spanner(t))
	r := &rpcs{}
	b, err := spannerlock.New(newClient(t, database(t), p.Addr(), r), spannerlock.WithTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
	storetest.CheckHistory(t, storetest.Harness{Backend: b, TTL: ttl, Step: step, Faults: eitherLoss{r: r, p: p}},
		storetest.HistoryOptions{Ops: 1000, Keys: 2, ClientsPerKey: 4, FaultRate: 0.1})
}

// The history check with every key in ONE database and no fault: the
// eight clients' transactions contend, and the emulator answers all but
// one of a database's concurrent transactions with Aborted, or with
// NotFound or FailedPrecondition naming the transaction (at the Commit
// too), but every reply arrives. The check fails any call answered with
// an error: Claim, Complete and Extend took such a Commit for a lost
// reply and answered "the outcome is unknown" (or "not run again") in
// 36 to 72 calls of 1,000 per run.
func TestHistoryOneDatabaseWithoutFaults(t *testing.T) {
	const (
		step = 50 * time.Millisecond // leases of 50, 100 and 200ms
		ttl  = 20 * step
	)
	b, _ := newBackend(t, "", spannerlock.WithTTL(ttl))
	storetest.CheckHistory(t, storetest.Harness{Backend: b, TTL: ttl, Step: step},
		storetest.HistoryOptions{Ops: 1000, Keys: 2, ClientsPerKey: 4})
}

// eitherLoss is storetest.Faults whose lost reply is, at random, the
// proxy's next reply chunk or the client's next Commit reply.
type eitherLoss faults

func (f eitherLoss) LoseNextReply() {
	if rand.IntN(2) == 0 {
		f.p.LoseNextReply()
	} else {
		f.r.loseNextCommit.Store(true)
	}
}

func (f eitherLoss) CutConnections() { f.p.CutConnections() }
