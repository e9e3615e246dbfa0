package testsvc

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// Required reports whether a missing service must fail rather than skip:
// under CI=true, or IDEMPOTENCY_REQUIRE_SERVICES=1.
func Required() bool {
	return os.Getenv("CI") == "true" || os.Getenv("IDEMPOTENCY_REQUIRE_SERVICES") == "1"
}

// Missing skips t, or fails it when [Required], for a service that is
// absent; how tells the reader how to get the service.
func Missing(t testing.TB, service, how string) {
	t.Helper()
	if Required() {
		t.Fatalf("%s is required here (CI or IDEMPOTENCY_REQUIRE_SERVICES=1) but missing: %s", service, how)
	}
	t.Skipf("%s not available; %s", service, how)
}

// FreePort returns a loopback TCP port that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// freeAddr returns a free loopback port and its host:port.
func freeAddr() (int, string, error) {
	port, err := FreePort()
	if err != nil {
		return 0, "", err
	}
	return port, fmt.Sprintf("127.0.0.1:%d", port), nil
}

var (
	mu      sync.Mutex
	running []*Process
)

// Process is a service process this package started.
type Process struct {
	// Name names the service, in messages and in its log file's name.
	Name string
	// Addr is the host:port the service listens on.
	Addr string

	args []string
	bin  string
	dir  string
	cmd  *exec.Cmd
	log  *os.File
	done chan struct{} // closed when cmd has exited
	// prepare adjusts the command before each start (for example to run
	// it as another user).
	prepare func(*exec.Cmd) error
	// removeDir: StopAll deletes dir (a shared instance's temp dir).
	removeDir bool
}

// Start runs bin with args in dir, logging to dir/NAME.log, and waits until
// ready(addr) succeeds. The process dies with the test binary, or at
// [StopAll].
func Start(name, bin, dir, addr string, args []string, ready func(addr string) error) (*Process, error) {
	p := &Process{Name: name, Addr: addr, args: args, bin: bin, dir: dir}
	return p.launch(ready)
}

// launch starts p, waits until it is ready and registers it for StopAll.
func (p *Process) launch(ready func(addr string) error) (*Process, error) {
	if err := p.start(ready); err != nil {
		return nil, err
	}
	mu.Lock()
	running = append(running, p)
	mu.Unlock()
	return p, nil
}

func (p *Process) start(ready func(addr string) error) error {
	f, err := os.OpenFile(filepath.Join(p.dir, p.Name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Dir = p.dir
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if p.prepare != nil {
		if err := p.prepare(cmd); err != nil {
			f.Close()
			return err
		}
	}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("starting %s: %w", p.Name, err)
	}
	exited := make(chan struct{})
	p.cmd, p.log, p.done = cmd, f, exited
	go func() { cmd.Wait(); close(exited) }()
	deadline := time.Now().Add(startTimeout)
	for {
		err := ready(p.Addr)
		if err == nil {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("%s exited before it was ready (log: %s): %s", p.Name, f.Name(), tail(f.Name()))
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.Kill()
			return fmt.Errorf("%s not ready on %s after %v: %v (log: %s)", p.Name, p.Addr, startTimeout, err, f.Name())
		}
	}
}

// startTimeout is how long a server may take to accept connections: a
// JVM emulator on a loaded 2-core machine has been seen to need more than
// 30 seconds. A server that exits meanwhile fails at once.
const startTimeout = 2 * time.Minute

// Kill ends the process at once, as a crash would.
func (p *Process) Kill() {
	if p.cmd != nil && p.cmd.Process != nil {
		// The whole tree, in case a server moved its children out of the
		// process group (their connections must die with it).
		for _, pid := range descendants(p.cmd.Process.Pid) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		p.cmd.Process.Kill()
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
		}
	}
	if p.log != nil {
		p.log.Close()
		p.log = nil
	}
}

// descendants lists the processes below pid, read from /proc.
func descendants(pid int) []int {
	entries, _ := os.ReadDir("/proc")
	parent := map[int]int{}
	for _, e := range entries {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces, so split after ')'.
		rest := stat[strings.LastIndexByte(string(stat), ')')+1:]
		var state string
		var ppid int
		fmt.Sscan(string(rest), &state, &ppid)
		parent[n] = ppid
	}
	var out []int
	frontier := []int{pid}
	for len(frontier) > 0 {
		cur := frontier[0]
		frontier = frontier[1:]
		for child, pp := range parent {
			if pp == cur {
				out = append(out, child)
				frontier = append(frontier, child)
			}
		}
	}
	return out
}

// Restart kills the process and starts it again with the same arguments
// and address (and the same data directory), waiting until ready(addr)
// succeeds.
func (p *Process) Restart(ready func(addr string) error) error {
	p.Kill()
	return p.start(ready)
}

// StopAll kills every process this package started and deletes the shared
// servers' directories. Call it from TestMain after m.Run.
func StopAll() {
	mu.Lock()
	defer mu.Unlock()
	for _, p := range running {
		p.Kill()
		if p.removeDir {
			os.RemoveAll(p.dir)
		}
	}
	running = nil
}

// tail returns the last 2000 bytes of the file at path.
func tail(path string) string {
	b, _ := os.ReadFile(path)
	s := strings.TrimSpace(string(b))
	if len(s) > 2000 {
		s = s[len(s)-2000:]
	}
	return s
}

// own ends the test when a server of its own failed to start, and kills
// the server when the test ends.
func own(t testing.TB, p *Process, err error) *Process {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return p
}

// shared is a server started at most once per test binary, and kept until
// StopAll.
type shared struct {
	once sync.Once
	addr string // its address or DSN, once started
	err  error
	up   atomic.Bool // set once this binary started the server
}

// get returns the server's address or DSN, starting it on first use: start
// runs the server in a fresh temporary directory named after prefix, which
// StopAll deletes. A failed start fails every test that asks.
func (s *shared) get(t testing.TB, prefix string, start func(dir string) (*Process, string, error)) string {
	t.Helper()
	s.once.Do(func() {
		dir, err := os.MkdirTemp("", prefix)
		if err != nil {
			s.err = err
			return
		}
		p, addr, err := start(dir)
		if err != nil {
			os.RemoveAll(dir)
			s.err = err
			return
		}
		p.removeDir = true
		s.addr = addr
		s.up.Store(true)
	})
	if s.err != nil {
		t.Fatal(s.err)
	}
	return s.addr
}

// started reports whether this binary started the server.
func (s *shared) started() bool { return s.up.Load() }
