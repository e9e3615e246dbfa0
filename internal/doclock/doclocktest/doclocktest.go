// Package doclocktest is the behaviour suite of the document-store
// backends (datastorelock, firestorelock): each case is written once,
// against a [Driver] that a backend's tests provide, and runs on that
// backend's emulator. A backend's own tests keep only what is its own: its
// client, its RPC shapes, its transactions.
//
// Run it from a backend's tests:
//
//	func TestDriver(t *testing.T) { doclocktest.Run(t, driver{}) }
//
// Each case is a subtest named after the behaviour it checks, selectable
// with -run (for example -run 'TestDriver/ServerClock').
package doclocktest

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// Backend is what the suite calls of a document-store backend.
type Backend interface {
	store.Backend
	store.Extender
	store.Fingerprinter
	store.Operator
	store.Purger
	TTL() time.Duration
}

// Config is how a case wants a backend built. The zero value is a backend
// with the defaults, in a space of records of its own, on the real clock.
type Config struct {
	// Space is the namespace (Datastore) or collection (Firestore) of the
	// records; "" is a fresh one.
	Space string
	// Clock is the backend's own clock (WithClock); nil is the real one.
	Clock func() time.Time
	// Server, when set, is the service's clock: every reply carries its
	// time, read as the request leaves.
	Server func() time.Time
	// TTL is the backend's ttl; 0 is the default.
	TTL time.Duration
	// Retries, when set, is the backend's WithRetries.
	Retries *int
}

// Retries returns a Config.Retries of n.
func Retries(n int) *int { return &n }

// Raw is a record as a version of the backends from before fingerprints
// wrote it: the properties (fields) state, fence, lease_expiry,
// expires_at and token, and no fingerprint.
type Raw struct {
	Key          string
	State, Fence int64
	Lease, Exp   time.Time
	Token        string
}

// Driver is what a backend's tests provide the suite.
type Driver interface {
	// Emulator starts the backend's emulator (testsvc), or skips t as
	// testsvc does when it is missing.
	Emulator(t testing.TB)
	// Space returns a fresh namespace or collection.
	Space() string
	// New builds a backend on the emulator as c says, on a connection of
	// its own whose RPCs Calls counts and whose faults it injects.
	New(t testing.TB, c Config) (Backend, *Calls)
	// StampsTime reports whether the emulator's replies carry a server
	// time of their own (the real time): a backend on a fake clock then
	// needs Config.Server set to that clock too, or the replies contradict
	// it. (The Datastore emulator reports none; the Firestore emulator
	// does.)
	StampsTime() bool
	// PutRaw writes recs into space exactly as given.
	PutRaw(t testing.TB, space string, recs ...Raw)
	// Contract builds a backend as New does, reached through a
	// testsvc.DropProxy, and the faults (storetest.Faults) of both.
	Contract(t *testing.T, c Config) (Backend, storetest.Faults)
}

// Calls counts a backend's RPCs by method name, and injects the faults a
// case sets. A driver's gRPC interceptor calls [Calls.Before] and
// [Calls.After] around each RPC, and answers a returned [Fault] instead
// of the reply.
type Calls struct {
	mu    sync.Mutex
	calls []string
	// LoseNext loses the reply of the next RPC, whatever its method.
	LoseNext atomic.Bool
	// LoseNextCommit loses the reply of the next Commit.
	LoseNextCommit atomic.Bool
	// DropNextCommit fails the next Commit without sending it.
	DropNextCommit atomic.Bool
	// AbortNextCommit answers the next Commit, which applied, with Aborted
	// (a resent commit refused as aborted after the first applied).
	AbortNextCommit atomic.Bool
	// Lost counts the replies lost and requests dropped.
	Lost atomic.Int32
	// WhileLost, when set, runs after a reply was lost or a request
	// dropped, before the backend hears of it.
	WhileLost func()
}

// Fault is an injected failure: the gRPC status code (Unavailable or
// Aborted) and message a driver's interceptor answers with.
type Fault struct {
	Code uint32
	Msg  string
}

// The gRPC codes of the faults.
const (
	codeAborted     = 10
	codeUnavailable = 14
)

// Before counts an RPC of method (its full gRPC name) and returns its
// short name, and the fault to answer without sending it (nil: send it).
func (c *Calls) Before(method string) (string, *Fault) {
	name := method
	for i := len(method) - 1; i >= 0; i-- {
		if method[i] == '/' {
			name = method[i+1:]
			break
		}
	}
	c.mu.Lock()
	c.calls = append(c.calls, name)
	c.mu.Unlock()
	if name == "Commit" && c.DropNextCommit.CompareAndSwap(true, false) {
		c.lose()
		return name, &Fault{codeUnavailable, "injected: the commit was lost before it reached the server"}
	}
	return name, nil
}

// After returns the fault to answer instead of the reply of RPC name,
// which ended with err (nil: answer it).
func (c *Calls) After(name string, err error) *Fault {
	if err != nil {
		return nil
	}
	if name == "Commit" && c.AbortNextCommit.CompareAndSwap(true, false) {
		return &Fault{codeAborted, "injected: the commit applied but was answered Aborted"}
	}
	if c.LoseNext.CompareAndSwap(true, false) || name == "Commit" && c.LoseNextCommit.CompareAndSwap(true, false) {
		c.lose()
		return &Fault{codeUnavailable, "injected: the request applied but its reply was lost"}
	}
	return nil
}

// LoseStreamed reports whether a streamed reply is to be lost (the next
// reply is), counting it.
func (c *Calls) LoseStreamed() bool {
	if c.LoseNext.CompareAndSwap(true, false) {
		c.lose()
		return true
	}
	return false
}

// lose counts a lost reply or dropped request and runs WhileLost.
func (c *Calls) lose() {
	c.Lost.Add(1)
	if c.WhileLost != nil {
		c.WhileLost()
	}
}

// Take returns the names of the RPCs sent since the last Take.
func (c *Calls) Take() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	calls := c.calls
	c.calls = nil
	return calls
}

// NewClock returns a fake clock at the instant the tests start from.
func NewClock() *fake.Clock { return fake.NewClock(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)) }

// Skew is how far the client clocks of the server-clock cases are off:
// more than a lease and more than a ttl.
const Skew = 3 * time.Hour

// Skewed is a client clock that reads server's time off by d.
func Skewed(server *fake.Clock, d time.Duration) func() time.Time {
	return func() time.Time { return server.Now().Add(d) }
}

// The lease and ttl of the server-clock cases.
const (
	scLease = time.Minute
	scTTL   = 10 * time.Minute
)

// h is a case's view of the driver.
type h struct{ Driver }

// onClock returns a backend that judges time by clock (its replies carry
// clock's time when the emulator stamps its own).
func (d h) onClock(t testing.TB, clock *fake.Clock, c Config) (Backend, *Calls) {
	t.Helper()
	c.Clock = clock.Now
	if d.StampsTime() && c.Server == nil {
		c.Server = clock.Now
	}
	return d.New(t, c)
}

// twoOnOneClock returns two backends on one space and one fake clock.
func (d h) twoOnOneClock(t testing.TB) (a Backend, ra *Calls, b Backend, clock *fake.Clock) {
	t.Helper()
	clock = NewClock()
	space := d.Space()
	a, ra = d.onClock(t, clock, Config{Space: space})
	b, _ = d.onClock(t, clock, Config{Space: space})
	return a, ra, b, clock
}

// onServer returns a backend whose replies carry server's time and whose
// own clock is off it by off.
func (d h) onServer(t testing.TB, server *fake.Clock, space string, off time.Duration) Backend {
	t.Helper()
	b, _ := d.New(t, Config{Space: space, Server: server.Now, TTL: scTTL, Clock: Skewed(server, off)})
	return b
}

// Two instances whose clocks are off the server's by Skew, in each
// direction.
var skews = []struct {
	name          string
	holder, other time.Duration
}{
	{"holder_behind_other_ahead", -Skew, Skew},
	{"holder_ahead_other_behind", Skew, -Skew},
	{"holder_on_time_other_ahead", 0, Skew},
	{"holder_behind_other_on_time", -Skew, 0},
}

// twoOnServer returns a server clock and two backends on one space whose
// replies carry its time, their own clocks off it by holderOff and
// otherOff.
func (d h) twoOnServer(t testing.TB, holderOff, otherOff time.Duration) (server *fake.Clock, holder, other Backend) {
	t.Helper()
	server = NewClock()
	space := d.Space()
	return server, d.onServer(t, server, space, holderOff), d.onServer(t, server, space, otherOff)
}

// eachSkew runs test once for each of skews, as a subtest, on a server
// clock and two backends whose own clocks are off it that way.
func (d h) eachSkew(t *testing.T, test func(t *testing.T, server *fake.Clock, holder, other Backend)) {
	d.Emulator(t)
	for _, sk := range skews {
		t.Run(sk.name, func(t *testing.T) {
			server, holder, other := d.twoOnServer(t, sk.holder, sk.other)
			test(t, server, holder, other)
		})
	}
}

// heldWithALostCommitNext returns two backends on one fake clock, the first
// holding key "k" for a minute with claim c, and the reply of its next
// Commit set to be lost.
func (d h) heldWithALostCommitNext(t *testing.T) (a Backend, ra *Calls, b Backend, clock *fake.Clock, c store.Claim) {
	t.Helper()
	d.Emulator(t)
	a, ra, b, clock = d.twoOnOneClock(t)
	r, err := a.Claim(t.Context(), "k", time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim: %v %v", r.Outcome, err)
	}
	ra.LoseNextCommit.Store(true)
	return a, ra, b, clock, r.Claim
}

// Claim claims key on b for lease and fails t unless it is won.
func Claim(t testing.TB, b store.Backend, key string, lease time.Duration) store.Claim {
	t.Helper()
	r, err := b.Claim(t.Context(), key, lease)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim %q: %v %v", key, r.Outcome, err)
	}
	return r.Claim
}

// Run runs every case of the suite on d, each a subtest named after the
// behaviour it checks.
func Run(t *testing.T, d Driver) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { c.run(t, h{d}) })
	}
}

// cases are the suite's cases, in the order they run; each file of the
// package adds its own.
var cases []testCase

type testCase struct {
	name string
	run  func(t *testing.T, drv h)
}

// add registers cases (in an init of each file).
func add(cs ...testCase) { cases = append(cases, cs...) }
