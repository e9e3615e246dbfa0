package e2e

import (
	"database/sql"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
)

// The pull storm's settings beyond the push storm's (stormSettings: the
// orders, processes, crash rate, kill beat, lease and backends are theirs).
const (
	// pullMaxOutstanding is each subscriber's MaxOutstandingMessages.
	pullMaxOutstanding = 2
	// pullAckDeadline is the subscription's ack deadline and the
	// subscribers' MaxDurationPerAckExtension, the shortest either takes:
	// a message held by a killed process comes back after it.
	pullAckDeadline = 10 * time.Second
	// pullSinkTable is where the transactional storm's handler writes.
	pullSinkTable = "e2e_pull_sink"
)

// The pull crash storm, on every backend: a fleet of subscriber processes
// (internal/pullsub) Receiving from one pull subscription of the Pub/Sub
// emulator through the pull adapter, keyed by the order's po_id attribute;
// a quarter of the orders published twice under two messageIds; each
// process's MaxExtension is half the lease, the ack deadline the shortest
// (10 s); processes exit right after the supplier accepted an order and
// before the key was completed (each key at most once, none after the
// kills stop), and a process that is inside the callback
// is SIGKILLed at a steady beat, each restarted. The
// supplier's log is judged by the push storm's rules (judge): every order
// reaches the supplier, no body runs again unless the run before it died
// in its window or was fenced out, and every order's record ends Done.
func TestPullCrashStorm(t *testing.T) {
	p := stormParamsForTest(t)
	var results []pullStormResult
	for _, b := range p.Backends {
		t.Run(b, func(t *testing.T) {
			r := runPullStorm(t, b, false, p)
			results = append(results, r)
			r.report(t, p.Lease)
		})
	}
	for _, r := range results {
		t.Log(r)
	}
}

// The pull crash storm on PostgreSQL through pgx (store/pgxlock over a
// *pgxpool.Pool): TestPullCrashStorm's storm and judge, with
// subscribers that run pull.Handler on pgxlock, and every key's record
// read back through pgxlock at the end.
func TestPullCrashStormOnPgxlock(t *testing.T) {
	p := stormParamsForTest(t)
	runPullStorm(t, "pgxlock", false, p).report(t, p.Lease)
}

// The transactional pull crash storm: HandlerTx on PostgreSQL, the
// handler's effect an INSERT into a sink table in the same database, in
// the transaction that marks the key done; processes exit after the
// INSERT and before the commit, and are SIGKILLed inside the callback.
// Nothing is excused: every order has exactly one row, and its key is
// Done.
func TestPullCrashStormTransactionalOnPostgres(t *testing.T) {
	transactionalPullStorm(t, "postgres")
}

// TestPullCrashStormTransactionalOnPostgres's storm and judge on pgxlock:
// pull.HandlerTx with pgx.Tx, the INSERT on the handler's pgx.Tx.
func TestPullCrashStormTransactionalOnPgxlock(t *testing.T) {
	transactionalPullStorm(t, "pgxlock")
}

// transactionalPullStorm runs the transactional pull storm on backend
// (postgres or pgxlock) and fails t unless every order has exactly one
// row and every key is done.
func transactionalPullStorm(t *testing.T, backend string) {
	p := stormParamsForTest(t)
	r := runPullStorm(t, backend, true, p)
	r.report(t, p.Lease)
	if r.Lost+r.Duplicates+r.NotDone != 0 {
		t.Errorf("want exactly one row per order and every key done: %v", r)
	}
}

// The pull storm cannot pass vacuously: on subscribers whose backend has
// a defect that breaks "nothing twice" (brokenBackends), the same storm
// (smaller, on Redis, and with the first defect on pgxlock too) reports
// duplicates.
func TestPullCrashStormCatchesBrokenBackends(t *testing.T) {
	p := stormParamsForTest(t)
	p.PullOrders, p.Instances = 20, 4
	for i, bb := range brokenBackends {
		backends := []string{"redis"}
		if i == 0 {
			backends = append(backends, "pgxlock")
		}
		for _, backend := range backends {
			t.Run(bb.name+"/"+backend, func(t *testing.T) {
				r := runPullStorm(t, backend, false, p, "E2E_BROKEN="+bb.name)
				t.Log(r)
				if r.Duplicates == 0 {
					t.Fatalf("the pull storm did not catch a backend where %s: %v", bb.defect, r.Problems)
				}
				t.Logf("caught: %d problems, the first: %s", len(r.Problems), r.Problems[0])
			})
		}
	}
}

// The transactional pull storm's strict judge is not vacuous: on
// subscribers whose handler INSERTs on the pool instead of the
// handler's pgx.Tx (E2E_BROKEN=write-outside-tx), a crash or a kill
// between the INSERT and the commit leaves a row that the redelivery
// writes again, and the storm reports the duplicate rows. The crash rate
// is 0.5, so that some of its 20 orders crash (all but one in a million
// runs).
func TestPullCrashStormTransactionalCatchesWritesOutsideTheTransaction(t *testing.T) {
	p := stormParamsForTest(t)
	p.PullOrders, p.Instances, p.CrashRate = 20, 4, 0.5
	r := runPullStorm(t, "pgxlock", true, p, "E2E_BROKEN=write-outside-tx")
	t.Log(r)
	if r.Duplicates == 0 {
		t.Fatalf("the transactional pull storm found no duplicate row with the sink written outside the transaction: %v", r.Problems)
	}
	t.Logf("caught: %d problems, the first: %s", len(r.Problems), r.Problems[0])
}

// pullMaxExtension is the subscribers' MaxExtension: half the lease, so
// that the handler's context (which the pull adapter bounds by it) ends
// well within the lease.
func pullMaxExtension(lease time.Duration) time.Duration { return lease / 2 }

// pullStormResult is what one pull storm did and what it found.
type pullStormResult struct {
	Name                     string
	Impl                     []string // the backend types the processes reported
	Orders, Processes        int
	Published                int // messages, republishes included
	Deliveries, Redeliveries int // callbacks; those beyond one per messageId
	Crashes, Kills           int64
	MidHandlerKills          int // SIGKILLs that found the process inside the callback
	Effects, Resends         int // supplier calls or sink rows; runs beyond the first per order
	Lost, Duplicates         int
	Overruns, NotDone        int
	Problems                 []string
	overrunNotes             []string
	Took                     time.Duration
	Phases                   []time.Duration // since the start: published, 90% in, all in, quiet
	Lease, KillEvery         time.Duration
	CrashRate                float64
}

func (r pullStormResult) String() string {
	return fmt.Sprintf("pull storm on %s %v: orders=%d processes=%d kills=%d mid-handler-kills=%d crashes=%d deliveries=%d redeliveries=%d re-sends=%d lost=%d duplicates=%d not-done=%d overruns=%d"+
		" (%d messages, %d effects, lease %v, max extension %v, ack deadline %v, crash rate %v, a kill every %v; %v, phases %v)",
		r.Name, r.Impl, r.Orders, r.Processes, r.Kills, r.MidHandlerKills, r.Crashes, r.Deliveries, r.Redeliveries, r.Resends, r.Lost, r.Duplicates, r.NotDone, r.Overruns,
		r.Published, r.Effects, r.Lease, pullMaxExtension(r.Lease), pullAckDeadline, r.CrashRate, r.KillEvery, r.Took.Round(time.Second), roundAll(r.Phases))
}

// report logs r and fails t with each of its problems.
func (r pullStormResult) report(t *testing.T, lease time.Duration) {
	t.Helper()
	t.Log(r)
	for _, pr := range r.Problems {
		t.Error(pr)
	}
	if r.Overruns > 0 {
		t.Logf("%d re-sends came after a run outlived its %v lease (the machine stalled it); each was logged as fenced out. A longer STORM_LEASE avoids them:\n%s",
			r.Overruns, lease, strings.Join(r.overrunNotes, "\n"))
	}
}

// runPullStorm runs one pull storm on backend (a name stormBackendEnv
// knows; with tx, HandlerTx into a sink table, on postgres or pgxlock)
// and judges it. Failures to set it up fail t; what the storm finds goes
// into the result's Problems.
func runPullStorm(t *testing.T, backend string, tx bool, p stormParams, extraEnv ...string) pullStormResult {
	start := time.Now()
	ps, sup := newPubSub(t, "pull-"+backend), newSupplier(t)
	backendEnv := stormBackendEnv(t, backend, ps)
	ps.topic(t, "orders")
	ps.subscribe(t, "orders-pull", "orders", "")
	// The storm must see a crash between an effect and its completion: a
	// pull storm handles about fifty messages, and at the push storm's 0.1
	// none crashed in 0.9^50, half a percent, of the runs (one such run
	// failed make test); at 0.2 that is 1 in 70,000.
	crashRate := max(p.CrashRate, 0.2)
	// Each key crashes at most once, and none after the kills stop (the
	// subscribers mark the keys here): a stranded message comes back
	// later each time it is stranded again, and unbounded crashes
	// stranded one past the wait (TestPullCrashStorm/redis in CI: 17
	// crashes, one key still not done after 6 minutes).
	crashDir := t.TempDir()
	env := []string{
		"PUBSUB_EMULATOR_HOST=" + testsvc.PubSub(t),
		"PUBSUB_PROJECT=" + ps.project,
		"PUBSUB_SUBSCRIPTION=orders-pull",
		"SUPPLIER_URL=" + sup.srv.URL,
		"IDEMPOTENCY_LEASE=" + p.Lease.String(),
		"E2E_MAX_EXTENSION=" + pullMaxExtension(p.Lease).String(),
		"E2E_ACK_EXTENSION=" + pullAckDeadline.String(),
		fmt.Sprint("E2E_MAX_OUTSTANDING=", pullMaxOutstanding),
		fmt.Sprint("E2E_CRASH_RATE=", crashRate),
		"E2E_CRASH_DIR=" + crashDir,
	}
	res := pullStormResult{Name: backend, Orders: p.PullOrders, Processes: p.Instances, Lease: p.Lease, CrashRate: crashRate, KillEvery: p.PullKillEvery}
	var sink *sql.DB
	if tx {
		res.Name = backend + " (HandlerTx, the sink in the same database)"
		sink = pullSink(t, envValue(backendEnv, "POSTGRES_DSN"))
		env = append(env, "E2E_MODE=tx", "E2E_SINK_TABLE="+pullSinkTable)
	}
	f := startProcesses(t, pullSubscriber(t), p.Instances, append(append(env, backendEnv...), extraEnv...)...)
	stopKillers := f.killEvery(p.PullKillEvery, func() { f.killInCallback(time.Second, p.PullKillEvery/2) })
	defer stopKillers()

	var keys []string
	keys, res.Published = publishOrders(t, ps, "orders", p.PullOrders, p.PullKillEvery)
	res.Phases = append(res.Phases, time.Since(start))
	// in counts the orders whose effect exists.
	in := func() int {
		if tx {
			rows, err := sinkRows(sink)
			if err != nil {
				t.Logf("reading the sink: %v", err)
			}
			return len(rows)
		}
		d, _ := sup.orders()
		return d
	}
	waitUntil(2*time.Minute+time.Duration(p.PullOrders)*300*time.Millisecond, func() bool {
		return in() >= p.PullOrders*9/10 && f.kills.Load() >= 3
	})
	stopKillers()
	if err := os.WriteFile(filepath.Join(crashDir, "stop"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	res.Phases = append(res.Phases, time.Since(start))
	// Wait until every key is reported done: a message whose holder
	// crashed comes back after the ack deadline, later each time it lapses
	// again (the emulator backs off), and only then completes.
	completedAt := func() map[string]time.Time {
		m := map[string]time.Time{}
		for _, c := range f.pullEvents("completed") {
			if at, ok := m[c.kv["key"]]; !ok || c.at.Before(at) {
				m[c.kv["key"]] = c.at
			}
		}
		return m
	}
	// A key is done when a process reported its completion, or a
	// delivery found it done (its completer was killed before the line).
	allDone := func() bool {
		done := completedAt()
		for _, c := range f.pullEvents("found-done") {
			done[c.kv["key"]] = c.at
		}
		for _, k := range keys {
			if _, ok := done[k]; !ok {
				return false
			}
		}
		return true
	}
	// The emulator doubles a message's redelivery delay each time its
	// deadline lapses again (10, 20, 40, 80, 160 s): the last key can take
	// minutes.
	if !waitUntil(6*time.Minute+time.Duration(p.PullOrders)*200*time.Millisecond, func() bool { return in() == p.PullOrders && allDone() }) {
		res.Problems = append(res.Problems, fmt.Sprintf("timed out with %d of %d orders in, all done: %v", in(), p.PullOrders, allDone()))
	}
	res.Phases = append(res.Phases, time.Since(start))
	if !quietFor(5*time.Second, time.Minute+time.Duration(p.PullOrders)*50*time.Millisecond, func() int64 {
		return int64(len(f.pullEvents("delivery")))
	}) {
		res.Problems = append(res.Problems, "deliveries were still arriving at the end")
	}
	res.Phases = append(res.Phases, time.Since(start))

	deliveries := f.pullEvents("delivery")
	ids := map[string]bool{}
	for _, d := range deliveries {
		ids[d.kv["id"]] = true
	}
	res.Deliveries, res.Redeliveries = len(deliveries), len(deliveries)-len(ids)
	res.Crashes, res.Kills, res.MidHandlerKills = f.crashes.Load(), f.kills.Load(), f.killedInCallback()
	res.Impl = backendTypes(f)
	if want, ok := pullStormImpl[backend]; ok && (len(res.Impl) != 1 || res.Impl[0] != want) {
		res.Problems = append(res.Problems, fmt.Sprintf("the subscribers ran on %v, not on %s alone", res.Impl, want))
	}
	completed := completedAt()
	if tx {
		rows, err := sinkRows(sink)
		if err != nil {
			t.Fatalf("reading the sink: %v", err)
		}
		res.judgeRows(keys, rows)
	} else {
		calls := sup.callLog()
		res.Effects = len(calls)
		v := judge(keys, calls, stormFacts{diedAt: f.diedAt,
			acked: func(key string) (time.Time, bool) { at, ok := completed[key]; return at, ok },
			fencedOut: func(n int64, key string, fence int64) bool {
				return fencedOutIn(f.logOf(n), key, fence)
			}})
		res.Lost, res.Resends, res.Overruns, res.Duplicates = len(v.lost), v.resends, len(v.overruns), len(v.duplicates)
		res.Problems = append(res.Problems, v.problems()...)
		res.overrunNotes = v.overruns
		if res.Resends == 0 {
			res.Problems = append(res.Problems, "no order was sent again after a crash: the crash window was never exercised")
		}
	}
	var notDone []string
	res.NotDone, notDone = notDoneProblems(t, backendEnv, keys)
	res.Problems = append(res.Problems, notDone...)
	// Guards against a storm that stormed nothing.
	if res.Crashes == 0 {
		res.Problems = append(res.Problems, "no process crashed between an effect and its completion")
	}
	if res.MidHandlerKills == 0 {
		res.Problems = append(res.Problems, fmt.Sprintf("no SIGKILL (of %d) found a process inside the callback", res.Kills))
	}
	if res.Redeliveries == 0 {
		res.Problems = append(res.Problems, "no message was delivered twice")
	}
	res.Took = time.Since(start)
	if dir := os.Getenv("E2E_DEBUG_LOGS"); dir != "" {
		for n := int64(1); n <= f.incarnations.Load(); n++ {
			os.WriteFile(filepath.Join(dir, fmt.Sprintf("process-%d.log", n)), []byte(f.logOf(n)), 0o644)
		}
	}
	return res
}

// pullStormImpl is the Go type of the backend the subscribers must report
// running on, by the storm's backend name, where the name says which.
var pullStormImpl = map[string]string{"postgres": "*sqllock.Backend", "pgxlock": "*pgxlock.Backend"}

// backendTypes returns the backend types the fleet's processes reported
// ("e2e: backend" lines), each once, sorted.
func backendTypes(f *fleet) []string {
	var types []string
	for _, e := range f.pullEvents("backend") {
		if !slices.Contains(types, e.kv["type"]) {
			types = append(types, e.kv["type"])
		}
	}
	slices.Sort(types)
	return types
}

// judgeRows judges the transactional storm's sink strictly: each order
// exactly one row, no row of a key no order has.
func (r *pullStormResult) judgeRows(keys []string, rows map[string][]sinkRow) {
	for _, rs := range rows {
		r.Effects += len(rs)
	}
	for _, k := range keys {
		switch rs := rows[k]; {
		case len(rs) == 0:
			r.Lost++
			r.Problems = append(r.Problems, fmt.Sprintf("lost: %s has no row in the sink", k))
		case len(rs) > 1:
			r.Duplicates++
			r.Problems = append(r.Problems, fmt.Sprintf("duplicate: %s has %d rows in the sink: %v", k, len(rs), rs))
		}
	}
	for k := range rows {
		if !slices.Contains(keys, k) {
			r.Problems = append(r.Problems, fmt.Sprintf("the sink has key %q, which no order has", k))
		}
	}
}

// sinkRow is one row the transactional storm's handler wrote.
type sinkRow struct {
	Fence       int64
	Incarnation string
	MessageID   string
}

// pullSink creates the sink table in the database of dsn and returns a
// connection to it, closed when t ends.
func pullSink(t *testing.T, dsn string) *sql.DB {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if _, err := db.ExecContext(t.Context(), "CREATE TABLE "+pullSinkTable+
		" (key text NOT NULL, fence bigint NOT NULL, incarnation text NOT NULL, message_id text NOT NULL)"); err != nil {
		t.Fatalf("creating the sink: %v", err)
	}
	return db
}

// sinkRows reads the sink, by key.
func sinkRows(db *sql.DB) (map[string][]sinkRow, error) {
	rows, err := db.Query("SELECT key, fence, incarnation, message_id FROM " + pullSinkTable)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string][]sinkRow{}
	for rows.Next() {
		var k string
		var r sinkRow
		if err := rows.Scan(&k, &r.Fence, &r.Incarnation, &r.MessageID); err != nil {
			return nil, err
		}
		out[k] = append(out[k], r)
	}
	return out, rows.Err()
}

// envValue returns the value of name in env (name=value entries).
func envValue(env []string, name string) string {
	for _, kv := range env {
		if k, v, _ := strings.Cut(kv, "="); k == name {
			return v
		}
	}
	return ""
}

// pullEvent is one "e2e: <what> k=v ... at=<unix µs>" line a subscriber
// wrote.
type pullEvent struct {
	process int64
	kv      map[string]string
	at      time.Time
}

// pullEvents returns every event named what in the logs of every process
// so far.
func (f *fleet) pullEvents(what string) []pullEvent {
	f.mu.Lock()
	logs := map[int64]*syncBuffer{}
	for n, b := range f.logs {
		logs[n] = b
	}
	f.mu.Unlock()
	var out []pullEvent
	for n, b := range logs {
		out = append(out, eventsIn(n, b.String(), what)...)
	}
	return out
}

// eventsIn parses the events named what in log, process n's.
func eventsIn(n int64, log, what string) []pullEvent {
	var out []pullEvent
	for line := range strings.Lines(log) {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "e2e: "+what+" ")
		if !ok {
			continue
		}
		e := pullEvent{process: n, kv: map[string]string{}}
		for _, f := range strings.Fields(rest) {
			if k, v, ok := strings.Cut(f, "="); ok {
				e.kv[k] = v
			}
		}
		us, _ := strconv.ParseInt(e.kv["at"], 10, 64)
		e.at = time.UnixMicro(us)
		out = append(out, e)
	}
	return out
}

// inCallback returns the messageIds whose callback log shows started and
// not returned.
func inCallback(log string) []string {
	open := map[string]int{}
	for _, e := range eventsIn(0, log, "delivery") {
		open[e.kv["id"]]++
	}
	for _, e := range eventsIn(0, log, "handled") {
		open[e.kv["id"]]--
	}
	var ids []string
	for id, n := range open {
		if n > 0 {
			ids = append(ids, id)
		}
	}
	return ids
}

// pullMaxStrandings is how often the pull storm's kills may strand one
// message: each kill of the process holding it sends it back only after
// the ack deadline, and the emulator doubles that wait for a message
// whose deadline lapsed before (10 s, 20 s, 40 s, ...).
const pullMaxStrandings = 2

// killInCallback SIGKILLs one process (at least minAge old) that is
// inside the callback, watching for one for up to wait; it kills none if
// no process is, or if each that is holds a message already delivered
// pullMaxStrandings times.
func (f *fleet) killInCallback(minAge, wait time.Duration) {
	for deadline := time.Now().Add(wait); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		deliveries := map[string]int{}
		for _, e := range f.pullEvents("delivery") {
			deliveries[e.kv["id"]]++
		}
	next:
		for _, i := range rand.Perm(len(f.instances)) {
			in := f.instances[i]
			in.mu.Lock()
			n := in.n
			in.mu.Unlock()
			ids := inCallback(f.logOf(n))
			for _, id := range ids {
				if deliveries[id] >= pullMaxStrandings {
					continue next
				}
			}
			if len(ids) > 0 && f.kill(i, minAge) {
				return
			}
		}
	}
}

// killedInCallback counts the processes that died inside the callback by
// a SIGKILL (not by the injected crash, which logs before it exits).
func (f *fleet) killedInCallback() int {
	f.mu.Lock()
	var dead []int64
	for n := range f.deaths {
		dead = append(dead, n)
	}
	f.mu.Unlock()
	k := 0
	for _, n := range dead {
		log := f.logOf(n)
		if !strings.Contains(log, "e2e: crashing") && len(inCallback(log)) > 0 {
			k++
		}
	}
	return k
}

var (
	pullSubOnce sync.Once
	pullSubBin  string
	pullSubErr  error
)

// pullSubscriber builds, once, the storm's subscriber (internal/pullsub).
func pullSubscriber(t *testing.T) string {
	pullSubOnce.Do(func() {
		bin := filepath.Join(buildDir, "pullsub")
		if out, err := exec.Command("go", "build", "-o", bin, "./internal/pullsub").CombinedOutput(); err != nil {
			pullSubErr = fmt.Errorf("building the pull subscriber: %v\n%s", err, out)
			return
		}
		pullSubBin = bin
	})
	if pullSubErr != nil {
		t.Fatal(pullSubErr)
	}
	return pullSubBin
}
