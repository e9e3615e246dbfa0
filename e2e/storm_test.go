package e2e

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/gcp-pubsub-idempotency/idempotency/function_example/orders"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/pgxlock"
)

// The storm's parameters: a flag (go test ./e2e -args -storm.orders=1000),
// else the environment variable, else the default, which keeps the run in
// make test moderate. make storm runs it at scale.
var stormSettings = []struct {
	flag, env, def, usage string
}{
	{"storm.orders", "STORM_ORDERS", "100", "orders per storm (a quarter of them published twice)"},
	{"storm.instances", "STORM_INSTANCES", "4", "function instances behind the balancer"},
	{"storm.crash-rate", "STORM_CRASH_RATE", "0.1", "chance that an instance exits right after a send, before Complete"},
	{"storm.kill-every", "STORM_KILL_EVERY", "300ms", "how often a random instance is SIGKILLed"},
	{"storm.pull-orders", "STORM_PULL_ORDERS", "40", "orders per pull storm (a subscriber's crash strands its messages for an ack deadline, doubled each time it recurs: the pull storm runs longer per order)"},
	{"storm.pull-kill-every", "STORM_PULL_KILL_EVERY", "3s", "how often the pull storm SIGKILLs a subscriber inside its callback (none if none is within half the interval; each kill strands the messages the process held for an ack deadline)"},
	{"storm.lease", "STORM_LEASE", "2s", "the function's lease (IDEMPOTENCY_LEASE)"},
	{"storm.backend", "STORM_BACKEND", "datastore,redis,postgres", "the backends to storm, in turn (comma-separated)"},
}

var stormFlags = func() map[string]*string {
	m := map[string]*string{}
	for _, s := range stormSettings {
		m[s.flag] = flag.String(s.flag, s.def, s.usage+" (env "+s.env+")")
	}
	return m
}()

// stormBackends are the backends STORM_BACKEND chooses from: those the
// example function (the push storm's) and the pull storm's subscribers
// both run. PostgreSQL through pgxlock, which only the subscribers run,
// has storms of its own (TestPullCrashStormOnPgxlock and
// TestPullCrashStormTransactionalOnPgxlock), as HandlerTx on PostgreSQL
// has, which STORM_BACKEND does not choose.
var stormBackends = []string{"datastore", "redis", "postgres"}

// stormParams are one storm's parameters.
type stormParams struct {
	Orders, Instances int
	CrashRate         float64
	KillEvery, Lease  time.Duration
	PullKillEvery     time.Duration
	PullOrders        int
	Backends          []string
}

// loadStormParams resolves each parameter from the flags that were set,
// then getenv, then the defaults, and refuses a storm that could not prove
// anything (no crashes, no kills, a single instance).
func loadStormParams(setFlags map[string]string, getenv func(string) string) (stormParams, error) {
	val := map[string]string{}
	for _, s := range stormSettings {
		v, ok := setFlags[s.flag]
		if !ok {
			v = getenv(s.env)
		}
		if v == "" {
			v = s.def
		}
		val[s.env] = v
	}
	var p stormParams
	var errs []error
	num := func(env string, parse func(string) error) {
		if err := parse(val[env]); err != nil {
			errs = append(errs, fmt.Errorf("%s=%q: %w", env, val[env], err))
		}
	}
	num("STORM_ORDERS", func(v string) (err error) {
		if p.Orders, err = strconv.Atoi(v); err == nil && p.Orders < 1 {
			err = errors.New("want at least 1")
		}
		return err
	})
	num("STORM_INSTANCES", func(v string) (err error) {
		if p.Instances, err = strconv.Atoi(v); err == nil && p.Instances < 2 {
			err = errors.New("want at least 2, or no delivery ever lands on another instance")
		}
		return err
	})
	num("STORM_CRASH_RATE", func(v string) (err error) {
		if p.CrashRate, err = strconv.ParseFloat(v, 64); err == nil && !(p.CrashRate > 0 && p.CrashRate < 1) {
			err = errors.New("want a rate strictly between 0 and 1: a storm without crashes proves nothing")
		}
		return err
	})
	num("STORM_KILL_EVERY", func(v string) (err error) {
		if p.KillEvery, err = time.ParseDuration(v); err == nil && p.KillEvery <= 0 {
			err = errors.New("want a positive interval: a storm without kills proves nothing")
		}
		return err
	})
	num("STORM_PULL_ORDERS", func(v string) (err error) {
		if p.PullOrders, err = strconv.Atoi(v); err == nil && p.PullOrders < 1 {
			err = errors.New("want at least 1")
		}
		return err
	})
	num("STORM_PULL_KILL_EVERY", func(v string) (err error) {
		if p.PullKillEvery, err = time.ParseDuration(v); err == nil && p.PullKillEvery <= 0 {
			err = errors.New("want a positive interval: a storm without kills proves nothing")
		}
		return err
	})
	num("STORM_LEASE", func(v string) (err error) {
		if p.Lease, err = time.ParseDuration(v); err == nil && p.Lease <= 0 {
			err = errors.New("want a positive lease")
		}
		return err
	})
	num("STORM_BACKEND", func(v string) error {
		for b := range strings.SplitSeq(v, ",") {
			b = strings.TrimSpace(b)
			if !slices.Contains(stormBackends, b) {
				return fmt.Errorf("unknown backend %q (want some of %s)", b, strings.Join(stormBackends, ","))
			}
			if !slices.Contains(p.Backends, b) {
				p.Backends = append(p.Backends, b)
			}
		}
		return nil
	})
	return p, errors.Join(errs...)
}

// stormParamsForTest reads the flags set on the command line and the
// environment.
func stormParamsForTest(t *testing.T) stormParams {
	t.Helper()
	set := map[string]string{}
	flag.Visit(func(f *flag.Flag) {
		if _, ok := stormFlags[f.Name]; ok {
			set[f.Name] = f.Value.String()
		}
	})
	p, err := loadStormParams(set, os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// stormResult is what one storm did and what it found.
type stormResult struct {
	Backend           string
	Orders, Instances int
	Published         int   // messages, republishes included
	Deliveries        int64 // push requests the balancer received
	Statuses          map[int]int
	Crashes, Kills    int64
	Calls, Resends    int // supplier calls; body runs beyond the first per order
	Lost, Duplicates  int // orders never supplied; re-sends nothing explains
	Overruns          int // re-sends after a run that outlived its lease (logged by the library)
	NotDone           int // orders whose record is not Done afterwards
	Problems          []string
	overrunNotes      []string
	Took              time.Duration
	Phases            []time.Duration // since the start: published, 90% supplied, all supplied, quiet
	Lease             time.Duration
	CrashRate         float64
	KillEvery         time.Duration
}

// String is the storm's line of figures.
func (r stormResult) String() string {
	return fmt.Sprintf("storm on %s: orders=%d instances=%d deliveries=%d crashes=%d kills=%d re-sends=%d lost=%d duplicates=%d not-done=%d overruns=%d"+
		" (%d messages on 2 subscriptions, statuses %v, %d supplier calls, lease %v, crash rate %v, a kill every %v; %v, phases %v)",
		r.Backend, r.Orders, r.Instances, r.Deliveries, r.Crashes, r.Kills, r.Resends, r.Lost, r.Duplicates, r.NotDone, r.Overruns,
		r.Published, r.Statuses, r.Calls, r.Lease, r.CrashRate, r.KillEvery, r.Took.Round(time.Second), roundAll(r.Phases))
}

// The crash storm, on every backend: a fleet of instances of the example
// function behind a round-robin balancer, real push subscriptions (two,
// so every message arrives twice) from the Pub/Sub emulator, a quarter of
// the orders published twice by the producer, instances exiting right
// after the supplier accepted an order and before the key was completed,
// and a random instance SIGKILLed at a steady beat, each restarted as
// Cloud Run replaces a dead instance. Every order must reach the supplier,
// no body may run again unless the run before it died in its window (or
// outlived its lease on a stalled machine and was fenced out, which is
// reported apart as an overrun), and every order's record must end Done.
// See judge for the exact rules.
func TestCrashStorm(t *testing.T) {
	p := stormParamsForTest(t)
	var results []stormResult
	for _, b := range p.Backends {
		t.Run(b, func(t *testing.T) {
			r := runStorm(t, b, p, serverBin)
			results = append(results, r)
			t.Log(r)
			for _, pr := range r.Problems {
				t.Error(pr)
			}
			if r.Overruns > 0 {
				t.Logf("%d re-sends came after a run outlived its %v lease (the machine stalled it); each was logged as fenced out. A longer STORM_LEASE avoids them:\n%s",
					r.Overruns, p.Lease, strings.Join(r.overrunNotes, "\n"))
			}
		})
	}
	for _, r := range results {
		t.Log(r)
	}
}

// brokenBackends are the defects the storm must catch, by name: the
// broken server (see brokenRegistration) wraps the real backend in one.
var brokenBackends = []struct{ name, defect string }{
	{"complete-noop", "Complete reports success without writing: the record stays Claimed and the next delivery after the lease runs the body again"},
	{"claim-always-wins", "Claim answers Won even when another holder's lease is live or the key is done"},
}

// The storm cannot pass vacuously: against a backend with a defect that
// breaks "nothing twice", the same storm (smaller, on Redis) must report
// duplicates. Each run uses the same oracle as TestCrashStorm.
func TestCrashStormCatchesBrokenBackends(t *testing.T) {
	p := stormParamsForTest(t)
	p.Orders, p.Instances = 20, 4
	bin := brokenServer(t)
	for _, bb := range brokenBackends {
		t.Run(bb.name, func(t *testing.T) {
			r := runStorm(t, "redis", p, bin, "E2E_BROKEN="+bb.name)
			t.Log(r)
			if r.Duplicates == 0 {
				t.Fatalf("the storm did not catch a backend where %s: %v", bb.defect, r.Problems)
			}
			t.Logf("caught: %d problems, the first: %s", len(r.Problems), r.Problems[0])
		})
	}
}

// runStorm runs one storm of bin on backend and judges it. Failures to
// set it up fail t; what the storm finds goes into the result's Problems.
func runStorm(t *testing.T, backend string, p stormParams, bin string, extraEnv ...string) stormResult {
	start := time.Now()
	ps, sup := newPubSub(t, "storm-"+backend), newSupplier(t)
	backendEnv := stormBackendEnv(t, backend, ps)
	env := append([]string{
		"FUNCTION_TARGET=HandleOrder",
		"SUPPLIER_URL=" + sup.srv.URL,
		"IDEMPOTENCY_LEASE=" + p.Lease.String(),
		fmt.Sprint("E2E_CRASH_RATE=", p.CrashRate),
	}, backendEnv...)
	f := startFleetOf(t, bin, p.Instances, append(env, extraEnv...)...)
	ps.topic(t, "orders")
	ps.subscribe(t, "orders-a", "orders", f.lb.URL)
	ps.subscribe(t, "orders-b", "orders", f.lb.URL)

	stopKillers := f.killEvery(p.KillEvery, func() { f.killAny(time.Second) })
	defer stopKillers()

	res := stormResult{Backend: backend, Orders: p.Orders, Instances: p.Instances, Lease: p.Lease, CrashRate: p.CrashRate, KillEvery: p.KillEvery}
	var keys []string
	keys, res.Published = publishOrders(t, ps, "orders", p.Orders, p.KillEvery)

	supplied := func() int {
		d, _ := sup.orders()
		return d
	}
	res.Phases = append(res.Phases, time.Since(start))
	// Kill until nine orders in ten are in (and a few kills landed), then
	// let the rest settle.
	waitUntil(2*time.Minute+time.Duration(p.Orders)*300*time.Millisecond, func() bool {
		return supplied() >= p.Orders*9/10 && f.kills.Load() >= 3
	})
	stopKillers()
	res.Phases = append(res.Phases, time.Since(start))
	if !waitUntil(time.Minute+time.Duration(p.Orders)*200*time.Millisecond, func() bool { return supplied() == p.Orders }) {
		res.Problems = append(res.Problems, fmt.Sprintf("timed out with %d of %d orders at the supplier", supplied(), p.Orders))
	}
	res.Phases = append(res.Phases, time.Since(start))
	if !f.quiet(5*time.Second, time.Minute+time.Duration(p.Orders)*50*time.Millisecond) {
		res.Problems = append(res.Problems, fmt.Sprintf("deliveries were still arriving at the end (statuses %v)", f.statusCounts()))
	}
	res.Phases = append(res.Phases, time.Since(start))

	res.Deliveries, res.Statuses = f.deliveries.Load(), f.statusCounts()
	res.Crashes, res.Kills = f.crashes.Load(), f.kills.Load()
	calls := sup.callLog()
	res.Calls = len(calls)
	v := judge(keys, calls, stormFacts{diedAt: f.diedAt, acked: f.firstAck, fencedOut: func(n int64, key string, fence int64) bool {
		return fencedOutIn(f.logOf(n), key, fence)
	}})
	res.Lost, res.Resends, res.Overruns, res.Duplicates = len(v.lost), v.resends, len(v.overruns), len(v.duplicates)
	res.Problems = append(res.Problems, v.problems()...)
	res.overrunNotes = v.overruns
	var notDone []string
	res.NotDone, notDone = notDoneProblems(t, backendEnv, keys)
	res.Problems = append(res.Problems, notDone...)
	// Guards against a storm that stormed nothing.
	if res.Crashes == 0 {
		res.Problems = append(res.Problems, "no instance crashed between a send and its completion")
	}
	if res.Kills == 0 {
		res.Problems = append(res.Problems, "no instance was SIGKILLed")
	}
	if res.Resends == 0 {
		res.Problems = append(res.Problems, "no order was sent again after a crash: the crash window was never exercised")
	}
	res.Took = time.Since(start)
	return res
}

// killEvery calls kill at every tick of interval until the returned stop
// is called (stop waits for the last kill; calling it again is a no-op).
func (f *fleet) killEvery(interval time.Duration, kill func()) (stop func()) {
	stopKilling := make(chan struct{})
	killerDone := make(chan struct{})
	go func() {
		defer close(killerDone)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			select {
			case <-stopKilling:
				return
			case <-tick.C:
				kill()
			}
		}
	}()
	return sync.OnceFunc(func() { close(stopKilling); <-killerDone })
}

// publishOrders publishes n orders on topic, each under a po_id attribute
// that names it, and a quarter of them twice (two messageIds, one order),
// as a producer retrying a publish does: ten orders per publish request,
// one request per interval, so the orders arrive over a stretch of the
// storm's kills rather than all before the first. It returns every order's
// key ("orders:" and the po_id) and the number of messages published.
// Order ids carry a run id, so storms sharing a server never share keys.
func publishOrders(t *testing.T, ps *pubsub, topic string, n int, interval time.Duration) (keys []string, published int) {
	run := fmt.Sprintf("%06d", rand.IntN(1e6))
	keys = make([]string, n)
	const perRequest = 10
	for i := 0; i < n; i += perRequest {
		if i > 0 {
			time.Sleep(interval)
		}
		var batch []pubMessage
		for j := i; j < min(i+perRequest, n); j++ {
			po := fmt.Sprintf("PO-%s-%05d", run, j)
			keys[j] = "orders:" + po
			m := pubMessage{attrs: map[string]string{"po_id": po}, data: order(po)}
			batch = append(batch, m)
			if j%4 == 0 {
				batch = append(batch, m)
			}
		}
		if err := ps.publishBatch(topic, batch); err != nil {
			t.Fatalf("publishing: %v", err)
		}
		published += len(batch)
	}
	return keys, published
}

// verdict is what judge found in a storm's supplier log.
type verdict struct {
	lost       []string // order keys the supplier never received
	unknown    []string // keys the supplier received that no order has
	resends    int      // body runs beyond the first, per key
	overruns   []string // re-sends after a run that outran its lease, described
	duplicates []string // re-sends nothing explains, described
}

// problems describes each lost, duplicated and unknown key of v.
func (v verdict) problems() []string {
	var out []string
	for _, k := range v.lost {
		out = append(out, fmt.Sprintf("lost: %s never reached the supplier", k))
	}
	out = append(out, v.duplicates...)
	for _, k := range v.unknown {
		out = append(out, fmt.Sprintf("the supplier got key %q, which no order has", k))
	}
	return out
}

// notDoneProblems runs notDoneKeys and describes each key it returns.
func notDoneProblems(t *testing.T, backendEnv []string, keys []string) (int, []string) {
	notDone := notDoneKeys(t, backendEnv, keys)
	var out []string
	for k, why := range notDone {
		out = append(out, fmt.Sprintf("%s: its record is not Done after the storm: %s", k, why))
	}
	return len(notDone), out
}

// stormFacts is what the harness saw of the fleet, beside the supplier's
// log.
type stormFacts struct {
	// diedAt reports when a process was seen to exit.
	diedAt func(process int64) (time.Time, bool)
	// acked reports when a delivery of key was first answered 2xx.
	acked func(key string) (time.Time, bool)
	// fencedOut reports whether a process logged that its run under fence
	// on key was fenced out at Complete (the library's loud report that the
	// work outran its lease and another delivery took the key).
	fencedOut func(process int64, key string, fence int64) bool
}

// judge reads the supplier's log of a storm. A body run is one (key,
// fence, process): repeats of one run's request are the HTTP client's,
// not a second run. Every run after a key's first is a re-send. A re-send
// is a duplicate unless all of these hold:
//
//   - its fence is above the previous run's (a new claim, not a second
//     holder of the same one);
//   - it arrived after the previous run's lease expiry (no one may run
//     while a live lease is held elsewhere);
//   - and the previous run ended in a way that leaves the key incomplete:
//     either its process had died before the re-send arrived and no
//     delivery of the key had been acked yet (the crash window: sent, then
//     died before completing), or its process logged that its Complete was
//     fenced out (an overrun: the run outlasted its lease and the library
//     said so; the storm reports these apart, and a longer lease avoids
//     them).
func judge(keys []string, calls []supplierCall, facts stormFacts) verdict {
	var v verdict
	runs := map[string][]supplierCall{}
	seen := map[supplierCall]bool{}
	for _, c := range calls {
		id := supplierCall{key: c.key, fence: c.fence, incarnation: c.incarnation}
		if seen[id] {
			continue
		}
		seen[id] = true
		runs[c.key] = append(runs[c.key], c)
	}
	want := map[string]bool{}
	for _, k := range keys {
		want[k] = true
		if len(runs[k]) == 0 {
			v.lost = append(v.lost, k)
		}
	}
	for k := range runs {
		if !want[k] {
			v.unknown = append(v.unknown, k)
		}
	}
	slices.Sort(v.unknown)
	for _, k := range keys {
		rs := runs[k]
		for i := 1; i < len(rs); i++ {
			prev, cur := rs[i-1], rs[i]
			v.resends++
			var why []string
			if cur.fence <= prev.fence {
				why = append(why, fmt.Sprintf("its fence is not above the previous run's %d", prev.fence))
			}
			if cur.at.Before(prev.leaseExpiry) {
				why = append(why, fmt.Sprintf("the previous run's lease (process %d, fence %d) was live for %v more",
					prev.incarnation, prev.fence, prev.leaseExpiry.Sub(cur.at).Round(time.Millisecond)))
			}
			died, dead := facts.diedAt(prev.incarnation)
			crashed := dead && died.Before(cur.at)
			ackedAt, acked := facts.acked(k)
			ackedBefore := acked && ackedAt.Before(cur.at)
			overrun := facts.fencedOut(prev.incarnation, k, prev.fence)
			switch {
			case len(why) > 0:
			case crashed && !ackedBefore:
				continue
			case overrun:
				v.overruns = append(v.overruns, fmt.Sprintf("overrun: %s ran again in process %d (fence %d) after process %d outran its lease (fence %d, fenced out at Complete)",
					k, cur.incarnation, cur.fence, prev.incarnation, prev.fence))
				continue
			case !crashed:
				why = append(why, fmt.Sprintf("process %d, which ran it before (fence %d), was still alive and was not fenced out", prev.incarnation, prev.fence))
			default:
				why = append(why, fmt.Sprintf("a delivery of the key was acked %v before", cur.at.Sub(ackedAt).Round(time.Millisecond)))
			}
			v.duplicates = append(v.duplicates, fmt.Sprintf("duplicate: %s ran again in process %d (fence %d): %s",
				k, cur.incarnation, cur.fence, strings.Join(why, "; ")))
		}
	}
	return v
}

// fencedOutIn reports whether log has the library's error line for a
// run on key under fence whose Complete was fenced out.
func fencedOutIn(log, key string, fence int64) bool {
	for line := range strings.Lines(log) {
		if !strings.Contains(line, "fenced out") {
			continue
		}
		f := strings.Fields(line)
		if slices.Contains(f, "key="+key) && slices.Contains(f, fmt.Sprint("fence=", fence)) {
			return true
		}
	}
	return false
}

// stormBackendEnv returns the environment that points the function at
// backend, set up for this storm alone: one of stormBackends, or
// "pgxlock", PostgreSQL through store/pgxlock, which only the pull
// storm's subscribers run (E2E_DRIVER=pgx).
func stormBackendEnv(t *testing.T, backend string, ps *pubsub) []string {
	switch backend {
	case "datastore":
		return []string{"IDEMPOTENCY_BACKEND=datastore", "DATASTORE_EMULATOR_HOST=" + testsvc.Datastore(t), "DATASTORE_PROJECT_ID=" + ps.project}
	case "redis":
		return []string{"IDEMPOTENCY_BACKEND=redis", "REDIS_ADDR=" + testsvc.Redis(t)}
	case "postgres":
		return []string{"IDEMPOTENCY_BACKEND=postgres", "POSTGRES_DSN=" + freshPostgresDatabase(t, testsvc.Postgres(t))}
	case "pgxlock":
		// The pull storm's subscribers only (internal/pullsub): the
		// example function knows no E2E_DRIVER.
		return []string{"E2E_DRIVER=pgx", "POSTGRES_DSN=" + freshPostgresDatabase(t, testsvc.Postgres(t))}
	}
	t.Fatalf("no storm set-up for backend %q", backend)
	return nil
}

// freshPostgresDatabase creates a database of its own on the server of dsn
// (a URL) and returns its DSN; it is dropped when t ends.
func freshPostgresDatabase(t *testing.T, dsn string) string {
	u, err := url.Parse(dsn)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Fatalf("the storm needs a postgres:// URL DSN, got %q", dsn)
	}
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	name := fmt.Sprintf("storm_%d", rand.Uint32())
	// A server that has just started accepts connections before it
	// accepts queries ("the database system is starting up").
	var err2 error
	if !waitUntil(time.Minute, func() bool {
		_, err2 = db.ExecContext(t.Context(), "CREATE DATABASE "+name)
		return err2 == nil
	}) {
		t.Fatalf("creating the storm's database: %v", err2)
	}
	t.Cleanup(func() {
		db, err := sql.Open("pgx", dsn)
		if err != nil {
			return
		}
		defer db.Close()
		db.Exec("DROP DATABASE IF EXISTS " + name + " WITH (FORCE)")
	})
	u.Path = "/" + name
	return u.String()
}

// notDoneKeys builds, in this process, the backend the function's
// environment chooses (pgxlock when it says E2E_DRIVER=pgx, as the pull
// storm's subscribers do), and claims every key: each must be
// AlreadyDone. It returns the keys that are not, with what Claim said.
func notDoneKeys(t *testing.T, backendEnv []string, keys []string) map[string]string {
	for _, kv := range backendEnv {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	var b store.Backend
	var err error
	if envValue(backendEnv, "E2E_DRIVER") == "pgx" {
		var pool *pgxpool.Pool
		if pool, err = pgxpool.New(t.Context(), envValue(backendEnv, "POSTGRES_DSN")); err == nil {
			defer pool.Close()
			b, err = pgxlock.New(pool)
		}
	} else {
		b, err = orders.Backend(t.Context())
	}
	if err != nil {
		t.Fatalf("the backend, in the test: %v", err)
	}
	if c, ok := b.(io.Closer); ok {
		defer c.Close()
	}
	var mu sync.Mutex
	bad := map[string]string{}
	next := make(chan string)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for k := range next {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				r, err := b.Claim(ctx, k, time.Second)
				cancel()
				if err != nil || r.Outcome != store.AlreadyDone {
					mu.Lock()
					bad[k] = fmt.Sprintf("Claim answered %v, %v", r.Outcome, err)
					mu.Unlock()
				}
			}
		})
	}
	for _, k := range keys {
		next <- k
	}
	close(next)
	wg.Wait()
	return bad
}

func roundAll(ds []time.Duration) []time.Duration {
	out := make([]time.Duration, len(ds))
	for i, d := range ds {
		out[i] = d.Round(100 * time.Millisecond)
	}
	return out
}

// waitUntil polls cond until it holds (true) or timeout passes (false).
func waitUntil(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
	return true
}

// quiet waits until the fleet has received no delivery for d; it reports
// false if that does not happen within timeout.
func (f *fleet) quiet(d, timeout time.Duration) bool {
	return quietFor(d, timeout, f.deliveries.Load)
}

// quietFor waits until count has not changed for d; it reports false if
// that does not happen within timeout.
func quietFor(d, timeout time.Duration, count func() int64) bool {
	deadline := time.Now().Add(timeout)
	last, since := count(), time.Now()
	for time.Since(since) < d {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
		if n := count(); n != last {
			last, since = n, time.Now()
		}
	}
	return true
}

// pubMessage is one message to publish.
type pubMessage struct {
	attrs map[string]string
	data  any
}

// publishBatch publishes msgs in one request; each gets its own messageId.
func (p *pubsub) publishBatch(topic string, msgs []pubMessage) error {
	var body []any
	for _, m := range msgs {
		b, _ := json.Marshal(m.data)
		body = append(body, map[string]any{"data": base64.StdEncoding.EncodeToString(b), "attributes": m.attrs})
	}
	b, _ := json.Marshal(map[string]any{"messages": body})
	resp, err := http.Post(p.base+"/v1/projects/"+p.project+"/topics/"+topic+":publish", "application/json", bytes.NewReader(b))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var out struct {
		MessageIDs []string `json:"messageIds"`
	}
	if resp.StatusCode/100 != 2 {
		e, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("publish: %s %s", resp.Status, e)
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return err
	}
	if len(out.MessageIDs) != len(msgs) {
		return fmt.Errorf("published %d messages, got %d ids", len(msgs), len(out.MessageIDs))
	}
	return nil
}

// brokenRegistration replaces the function package in the broken server's
// generated main: it registers HandleOrder as the example does, over the
// backend orders.Setup builds, wrapped (by internal/broken's Wrap, copied
// beside it) in the defect E2E_BROKEN names.
const brokenRegistration = `package main

import (
	"context"
	"log"
	"os"

	"github.com/GoogleCloudPlatform/functions-framework-go/functions"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/function_example/orders"
)

func init() {
	backend, lease, err := orders.Setup(context.Background())
	if err != nil {
		log.Fatal(err)
	}
	if os.Getenv("E2E_BROKEN") == "" {
		log.Fatal("E2E_BROKEN is not set: the broken server needs a defect")
	}
	if backend, err = Wrap(backend, os.Getenv("E2E_BROKEN")); err != nil {
		log.Fatal(err)
	}
	functions.CloudEvent("HandleOrder", idempotency.Idempotent(backend, orders.OrderOptions(lease)...)(orders.HandleOrder))
}
`

var (
	brokenOnce sync.Once
	brokenBin  string
	brokenErr  error
)

// brokenServer builds, once, the generated main of the example with its
// function package replaced by brokenRegistration.
func brokenServer(t *testing.T) string {
	brokenOnce.Do(func() {
		repo, err := filepath.Abs("..")
		if err != nil {
			brokenErr = err
			return
		}
		app := filepath.Join(buildDir, "broken")
		main := strings.Replace(generatedMain, "\t_ \"example.com/orders-function\"\n", "", 1)
		if main == generatedMain {
			brokenErr = errors.New("the generated main no longer imports the function package as expected")
			return
		}
		gomod := "module functions.local/broken\n\ngo 1.26\n\nrequire github.com/gcp-pubsub-idempotency/idempotency v0.0.0-00010101000000-000000000000\n" + localReplaces(repo)
		defects, err := os.ReadFile(filepath.Join("internal", "broken", "broken.go"))
		if err != nil {
			brokenErr = err
			return
		}
		defectsMain := strings.Replace(string(defects), "\npackage broken\n", "\npackage main\n", 1)
		if defectsMain == string(defects) {
			brokenErr = errors.New("internal/broken/broken.go no longer declares package broken as expected")
			return
		}
		for name, text := range map[string]string{"go.mod": gomod, "main.go": main, "broken.go": brokenRegistration, "defects.go": defectsMain} {
			if err := os.MkdirAll(app, 0o755); err != nil {
				brokenErr = err
				return
			}
			if err := os.WriteFile(filepath.Join(app, name), []byte(text), 0o644); err != nil {
				brokenErr = err
				return
			}
		}
		bin := filepath.Join(buildDir, "broken-server")
		for _, args := range [][]string{{"mod", "tidy"}, {"build", "-o", bin, "."}} {
			cmd := exec.Command("go", args...)
			cmd.Dir = app
			cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOWORK=off")
			if out, err := cmd.CombinedOutput(); err != nil {
				brokenErr = fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, out)
				return
			}
		}
		brokenBin = bin
	})
	if brokenErr != nil {
		t.Fatal(brokenErr)
	}
	return brokenBin
}
