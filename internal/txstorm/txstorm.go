// Package txstorm is a crash storm for transactional backends
// (store.TxBackend): worker processes deliver orders with
// idempotency.LockTx, each order's effect one row in the backend's own
// store, while the storm SIGKILLs workers at random moments and, on
// purpose, between a body's last write and its commit. Every delivery
// that does not end in an ack comes back (as Pub/Sub would redeliver it).
// When every order is acknowledged, each must have exactly one row: none
// lost, none twice.
//
// A backend's test calls Run from a test function; Run re-runs that test
// function in worker processes (the test binary with TXSTORM_WORKER set),
// so the same function is both the storm and its workers.
package txstorm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Config is one storm.
type Config[Tx any] struct {
	// Orders is how many orders are delivered; Workers how many worker
	// processes deliver them at once. Defaults: 200 and 4.
	Orders, Workers int
	// Lease is each claim's lease; a killed worker's claims free after
	// it. Default: 2s.
	Lease time.Duration
	// KillEvery is how often a random worker is SIGKILLed. Default:
	// 400ms.
	KillEvery time.Duration
	// WindowRate is the chance that a body, after its write, tells the
	// storm it is about to commit and waits for a moment, in which the
	// storm kills it. Default: 0.15.
	WindowRate float64
	// Timeout bounds the storm. Default: 4 minutes.
	Timeout time.Duration

	// Heartbeat, when positive, delivers with idempotency.WithHeartbeat
	// of that interval, and makes bodies last up to two intervals, so
	// that renewals run beside the body and its commit. It must be at
	// least idempotency.MinHeartbeat and below Lease.
	Heartbeat time.Duration
	// PanicRate is the chance that a body panics after its write (the
	// worker recovers the panic and nacks, as the functions framework
	// answers a panicking handler with a 500).
	PanicRate float64
	// SwallowRate is the chance that a body, after its write, runs
	// EndTx and returns nil whatever it returned: a body that logs a
	// failed statement and goes on. Requires EndTx when positive.
	SwallowRate float64
	// EndTx makes the store end tx under the body in the engine's own
	// way (see storetest.TxHarness.EndTx).
	EndTx func(ctx context.Context, tx Tx) error

	// Env is passed to the workers (addresses of the servers the parent
	// started, for example).
	Env []string

	// Backend opens the backend (in the storm's process and in each
	// worker). Required.
	Backend func(t testing.TB) store.TxBackend[Tx]
	// Write writes, in tx, one row for order. Required.
	Write func(ctx context.Context, tx Tx, order string) error
	// Count returns the committed rows for each order. Required.
	Count func(ctx context.Context) (map[string]int, error)
}

// Figures are what a storm counted.
type Figures struct {
	Orders, Workers           int
	Deliveries                int // LockTx calls made by workers and the final sweep
	Kills, WindowKills        int // SIGKILLs: of a worker delivering an order, and between a write and its commit
	Panics, Swallowed         int // bodies that panicked, and that swallowed a statement that ended their transaction
	Lost, Duplicated, Unknown int // orders with no row, with more than one, and rows of no order
}

func (f Figures) String() string {
	return fmt.Sprintf("%d orders, %d workers, %d deliveries, %d kills (%d between the write and the commit), %d panics, %d swallowed errors: %d lost, %d duplicated, %d unknown rows",
		f.Orders, f.Workers, f.Deliveries, f.Kills, f.WindowKills, f.Panics, f.Swallowed, f.Lost, f.Duplicated, f.Unknown)
}

const workerEnv = "TXSTORM_WORKER"

// backoff is how long a nacked order waits before it is delivered again.
const backoff = 100 * time.Millisecond

func (c *Config[Tx]) defaults() {
	if c.Orders <= 0 {
		c.Orders = 200
	}
	if c.Workers <= 0 {
		c.Workers = 4
	}
	if c.Lease <= 0 {
		c.Lease = 2 * time.Second
	}
	if c.KillEvery <= 0 {
		c.KillEvery = 400 * time.Millisecond
	}
	if c.WindowRate == 0 {
		c.WindowRate = 0.15
	}
	if c.Timeout <= 0 {
		c.Timeout = 4 * time.Minute
	}
}

// check reports a configuration the storm cannot run.
func (c *Config[Tx]) check() error {
	if c.SwallowRate > 0 && c.EndTx == nil {
		return fmt.Errorf("txstorm: SwallowRate %v needs EndTx", c.SwallowRate)
	}
	if c.Heartbeat > 0 && (c.Heartbeat < idempotency.MinHeartbeat || c.Heartbeat >= c.Lease) {
		return fmt.Errorf("txstorm: Heartbeat %v must be within [%v, Lease %v)", c.Heartbeat, idempotency.MinHeartbeat, c.Lease)
	}
	return nil
}

func order(i int) string { return fmt.Sprintf("order-%05d", i) }

// Run runs the storm and fails t if an order was lost or its effect
// duplicated, or if it killed no worker mid-delivery or none between a
// write and its commit; in a worker process it is the worker. It returns
// the figures.
func Run[Tx any](t *testing.T, cfg Config[Tx]) Figures {
	t.Helper()
	f := Storm(t, cfg)
	if IsWorker() {
		return f
	}
	if f.Lost > 0 || f.Duplicated > 0 || f.Unknown > 0 {
		t.Errorf("txstorm: %d lost, %d duplicated, %d unknown rows", f.Lost, f.Duplicated, f.Unknown)
	}
	if f.Kills == 0 || f.WindowKills == 0 {
		t.Errorf("txstorm: %d workers killed mid-delivery, %d between a write and its commit: the storm must do both to prove anything", f.Kills, f.WindowKills)
	}
	if (cfg.PanicRate > 0 && f.Panics == 0) || (cfg.SwallowRate > 0 && f.Swallowed == 0) {
		t.Errorf("txstorm: %d bodies panicked and %d swallowed an ended transaction: the storm was asked for both", f.Panics, f.Swallowed)
	}
	return f
}

// Storm is Run without the verdict: it runs the storm and returns what it
// counted, for a test that expects a broken sink to show.
func Storm[Tx any](t *testing.T, cfg Config[Tx]) Figures {
	t.Helper()
	cfg.defaults()
	if err := cfg.check(); err != nil {
		t.Fatal(err)
	}
	if IsWorker() {
		work(t, cfg)
		return Figures{}
	}
	return storm(t, cfg)
}

// work is a worker: it reads order names on stdin, delivers each once,
// and writes what came of it on stdout: "ack NAME" or "nack NAME", and
// "window NAME" before a commit it then waits at.
func work[Tx any](t *testing.T, cfg Config[Tx]) {
	b := cfg.Backend(t)
	ctx := context.Background()
	out := bufio.NewWriter(os.Stdout)
	var mu sync.Mutex
	say := func(s string) {
		mu.Lock()
		defer mu.Unlock()
		out.WriteString(s + "\n")
		out.Flush()
	}
	opts := []idempotency.LockOption{idempotency.WithLease(cfg.Lease), idempotency.WithSettleTimeout(5 * time.Second)}
	if cfg.Heartbeat > 0 {
		opts = append(opts, idempotency.WithHeartbeat(cfg.Heartbeat))
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		name := in.Text()
		err := deliver(ctx, b, name, cfg, say, opts)
		switch {
		case err == nil || idempotency.IsOwnDuplicate(err, name):
			say("ack " + name)
		default:
			say("nack " + name)
		}
	}
	os.Exit(0)
}

// errPanicked is a delivery whose body panicked: the worker nacks it.
var errPanicked = errors.New("txstorm: the body panicked")

// deliver is one delivery of order name: LockTx with a body that writes
// the order's row and then, by the configured chances, waits for the
// storm to kill it, runs beside the heartbeat, panics, or ends its
// transaction and swallows the error.
func deliver[Tx any](ctx context.Context, b store.TxBackend[Tx], name string, cfg Config[Tx], say func(string), opts []idempotency.LockOption) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = errPanicked
		}
	}()
	return idempotency.LockTx(ctx, b, name, func(ctx context.Context, tx Tx) error {
		if err := cfg.Write(ctx, tx, name); err != nil {
			return err
		}
		if cfg.Heartbeat > 0 {
			// Up to two renewals while the body runs, and one may land
			// during the commit.
			time.Sleep(time.Duration(rand.Int64N(int64(2 * cfg.Heartbeat))))
		}
		if rand.Float64() < cfg.WindowRate {
			say("window " + name)
			time.Sleep(300 * time.Millisecond) // the storm kills us here
		}
		switch r := rand.Float64(); {
		case r < cfg.PanicRate:
			say("panic " + name)
			panic("txstorm: the body panics after its write")
		case r < cfg.PanicRate+cfg.SwallowRate:
			say("swallow " + name)
			cfg.EndTx(ctx, tx) // its error is swallowed, as a careless body would
		}
		return nil
	}, opts...)
}

type worker struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	busy string // the order it is delivering
	// dead is set once its process has ended and its order (if any) was
	// put back: it gets no new order (an idle token it sent before it
	// died may still be in the channel).
	dead bool
}

func storm[Tx any](t *testing.T, cfg Config[Tx]) Figures {
	ctx, cancel := context.WithTimeout(t.Context(), cfg.Timeout)
	defer cancel()
	f := Figures{Orders: cfg.Orders, Workers: cfg.Workers}

	var (
		mu      sync.Mutex
		pending = make([]string, 0, cfg.Orders) // orders to (re)deliver
		acked   = map[string]bool{}
		workers = make([]*worker, cfg.Workers)
		idle    = make(chan int, cfg.Workers*4)
	)
	for i := range cfg.Orders {
		pending = append(pending, order(i))
	}
	rand.Shuffle(len(pending), func(i, j int) { pending[i], pending[j] = pending[j], pending[i] })

	var start func(i int)
	start = func(i int) {
		cmd := exec.Command(os.Args[0], "-test.run="+runPattern(t.Name()), "-test.count=1")
		cmd.Env = append(append(os.Environ(), workerEnv+"=1"), cfg.Env...)
		cmd.Stderr = io.Discard
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		in, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		outp, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		w := &worker{cmd: cmd, in: in}
		mu.Lock()
		workers[i] = w
		mu.Unlock()
		go func() {
			sc := bufio.NewScanner(outp)
			for sc.Scan() {
				verb, name, _ := strings.Cut(sc.Text(), " ")
				mu.Lock()
				switch verb {
				case "ack":
					f.Deliveries++
					acked[name] = true
					w.busy = ""
				case "nack":
					f.Deliveries++
					w.busy = ""
					// Pub/Sub redelivers a nack after a backoff.
					go func() {
						time.Sleep(backoff)
						mu.Lock()
						pending = append(pending, name)
						mu.Unlock()
					}()
				case "panic":
					f.Panics++
				case "swallow":
					f.Swallowed++
				case "window":
					if rand.IntN(2) == 0 {
						f.WindowKills++
						w.cmd.Process.Kill()
					}
				}
				mu.Unlock()
				if verb == "ack" || verb == "nack" {
					idle <- i
				}
			}
			// The worker ended (killed): its order comes back, and a new
			// worker takes its place.
			w.cmd.Wait()
			mu.Lock()
			w.dead = true
			if w.busy != "" {
				f.Deliveries++
				pending = append(pending, w.busy)
				w.busy = ""
			}
			stopped := ctx.Err() != nil
			mu.Unlock()
			if !stopped {
				start(i)
			}
		}()
		idle <- i
	}
	for i := range cfg.Workers {
		start(i)
	}
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for _, w := range workers {
			if w != nil {
				w.cmd.Process.Kill()
			}
		}
	}()

	kill := time.NewTicker(cfg.KillEvery)
	defer kill.Stop()
	done := func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(acked) == cfg.Orders
	}
	for !done() {
		select {
		case <-ctx.Done():
			mu.Lock()
			n := len(acked)
			mu.Unlock()
			t.Fatalf("txstorm: %d of %d orders acknowledged before the storm's %v ran out", n, cfg.Orders, cfg.Timeout)
		case <-kill.C:
			mu.Lock()
			// A worker that is delivering an order: killing an idle one
			// proves nothing.
			if w := workers[rand.IntN(len(workers))]; w != nil && w.cmd.Process != nil && w.busy != "" {
				f.Kills++
				w.cmd.Process.Kill()
			}
			mu.Unlock()
		case i := <-idle:
			mu.Lock()
			w := workers[i]
			if w.dead {
				// A token of a worker that has died since (killed after it
				// wrote its ack): its replacement sends its own.
				mu.Unlock()
				continue
			}
			var name string
			for len(pending) > 0 && name == "" {
				name, pending = pending[0], pending[1:]
				if acked[name] {
					name = ""
				}
			}
			if name != "" && w.busy == "" {
				w.busy = name
				if _, err := io.WriteString(w.in, name+"\n"); err != nil {
					// It was killed; its goroutine puts the order back.
				}
			} else if name != "" {
				pending = append(pending, name)
			}
			mu.Unlock()
			if name == "" {
				// Nothing to hand out now: look again soon (a nack or a
				// killed worker puts orders back).
				go func() { time.Sleep(50 * time.Millisecond); idle <- i }()
			}
		}
	}
	cancel()

	rows, err := cfg.Count(context.Background())
	if err != nil {
		t.Fatalf("txstorm: counting rows: %v", err)
	}
	for i := range cfg.Orders {
		switch n := rows[order(i)]; {
		case n == 0:
			f.Lost++
		case n > 1:
			f.Duplicated++
		}
		delete(rows, order(i))
	}
	f.Unknown = len(rows)
	t.Logf("txstorm: %v", f)
	return f
}

// IsWorker reports whether this process is a storm's worker: a test that
// starts servers for the storm must not start them again in a worker, but
// read their addresses from the environment the storm passes (Config.Env).
func IsWorker() bool { return os.Getenv(workerEnv) != "" }

// runPattern is the -test.run pattern that selects exactly the test (or
// subtest) named name.
func runPattern(name string) string {
	parts := strings.Split(name, "/")
	for i, p := range parts {
		parts[i] = "^" + regexp.QuoteMeta(p) + "$"
	}
	return strings.Join(parts, "/")
}
