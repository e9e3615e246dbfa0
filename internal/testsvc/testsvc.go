// Package testsvc starts the real services the backend tests run against,
// on free loopback ports, or points at ones the environment names.
//
// A service that is neither named nor installed skips the test with a
// message saying how to get it, except when Required reports true (CI=true,
// or IDEMPOTENCY_REQUIRE_SERVICES=1 as `make test` sets): then it fails the
// test, so that no backend passes by being skipped.
package testsvc

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Required reports whether a missing service must fail rather than skip.
func Required() bool {
	return os.Getenv("CI") == "true" || os.Getenv("IDEMPOTENCY_REQUIRE_SERVICES") == "1"
}

// Missing skips t, or fails it when Required, for a service that is absent.
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

var (
	mu      sync.Mutex
	running []*Process
)

// Process is a service process this package started.
type Process struct {
	Name string
	Addr string
	args []string
	bin  string
	dir  string
	cmd  *exec.Cmd
	log  *os.File
	done chan struct{} // closed when cmd has exited
}

// Start runs bin with args in dir, logging to dir/NAME.log, and waits until
// ready(addr) succeeds. The process dies with the test binary.
func Start(name, bin, dir, addr string, args []string, ready func(addr string) error) (*Process, error) {
	p := &Process{Name: name, Addr: addr, args: args, bin: bin, dir: dir}
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
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("starting %s: %w", p.Name, err)
	}
	exited := make(chan struct{})
	p.cmd, p.log, p.done = cmd, f, exited
	go func() { cmd.Wait(); close(exited) }()
	deadline := time.Now().Add(30 * time.Second)
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
			return fmt.Errorf("%s not ready on %s after 30s: %v (log: %s)", p.Name, p.Addr, err, f.Name())
		}
	}
}

// Kill ends the process at once, as a crash would.
func (p *Process) Kill() {
	if p.cmd != nil && p.cmd.Process != nil {
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

// Restart starts the process again with the same arguments and address.
func (p *Process) Restart(ready func(addr string) error) error {
	p.Kill()
	return p.start(ready)
}

// StopAll kills every process this package started. Call it from TestMain
// after m.Run.
func StopAll() {
	mu.Lock()
	defer mu.Unlock()
	for _, p := range running {
		p.Kill()
	}
	running = nil
}

func tail(path string) string {
	b, _ := os.ReadFile(path)
	s := strings.TrimSpace(string(b))
	if len(s) > 2000 {
		s = s[len(s)-2000:]
	}
	return s
}

// RedisReady answers whether a Redis server on addr answers PING.
func RedisReady(addr string) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if !strings.HasPrefix(line, "+PONG") {
		return fmt.Errorf("PING answered %q", strings.TrimSpace(line))
	}
	return nil
}

const redisHow = "install Debian's redis-server (apt-get install -y redis-server) or set REDIS_ADDR"

// StartRedis starts a redis-server of its own for t, with extra arguments
// (for example "--appendonly", "yes"), and stops it when t ends.
func StartRedis(t testing.TB, extra ...string) *Process {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		Missing(t, "redis-server", redisHow)
	}
	p, err := startRedis(bin, t.TempDir(), extra)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return p
}

func startRedis(bin, dir string, extra []string) (*Process, error) {
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	args := append([]string{
		"--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--dir", dir,
		"--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
	}, extra...)
	return Start("redis", bin, dir, fmt.Sprintf("127.0.0.1:%d", port), args, RedisReady)
}

var (
	sharedRedisOnce sync.Once
	sharedRedis     string
	sharedRedisErr  error
)

// Redis returns the address of a Redis server shared by the whole test
// binary: REDIS_ADDR when set, else one it starts. Tests sharing it must use
// keys of their own.
func Redis(t testing.TB) string {
	t.Helper()
	if addr := os.Getenv("REDIS_ADDR"); addr != "" {
		return addr
	}
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		Missing(t, "redis-server", redisHow)
	}
	sharedRedisOnce.Do(func() {
		dir, err := os.MkdirTemp("", "testsvc-redis-")
		if err != nil {
			sharedRedisErr = err
			return
		}
		p, err := startRedis(bin, dir, nil)
		if err != nil {
			sharedRedisErr = err
			return
		}
		sharedRedis = p.Addr
	})
	if sharedRedisErr != nil {
		t.Fatal(sharedRedisErr)
	}
	return sharedRedis
}

// DatastoreEmulator is where the gcloud SDK keeps the legacy Datastore
// emulator (the Firestore emulator's Datastore mode rejects some of what
// the backend does).
const DatastoreEmulator = "/usr/lib/google-cloud-sdk/platform/cloud-datastore-emulator/cloud_datastore_emulator"

const datastoreHow = "install the Google Cloud SDK's cloud-datastore-emulator (and a Java runtime), or set DATASTORE_EMULATOR_HOST"

// HTTPReady answers whether GET http://addr/ succeeds.
func HTTPReady(addr string) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", addr); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if !strings.Contains(line, " 200 ") {
		return fmt.Errorf("GET / answered %q", strings.TrimSpace(line))
	}
	return nil
}

var (
	datastoreOnce sync.Once
	datastoreAddr string
	datastoreErr  error
)

// Datastore returns the host:port of a Datastore emulator shared by the
// whole test binary, and sets DATASTORE_EMULATOR_HOST to it for clients in
// this process: the variable's own value when set, else an emulator it
// starts (in memory, consistency 1.0). Tests sharing it must use a
// namespace or kind of their own. Call it before any t.Parallel.
func Datastore(t testing.TB) string {
	t.Helper()
	if addr := os.Getenv("DATASTORE_EMULATOR_HOST"); addr != "" && datastoreAddr == "" {
		return addr
	}
	if _, err := os.Stat(DatastoreEmulator); err != nil {
		Missing(t, "the Datastore emulator", datastoreHow)
	}
	if _, err := exec.LookPath("java"); err != nil {
		Missing(t, "java (for the Datastore emulator)", datastoreHow)
	}
	datastoreOnce.Do(func() {
		dir, err := os.MkdirTemp("", "testsvc-datastore-")
		if err != nil {
			datastoreErr = err
			return
		}
		port, err := FreePort()
		if err != nil {
			datastoreErr = err
			return
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		_, datastoreErr = Start("datastore-emulator", DatastoreEmulator, dir, addr, []string{
			"start", "--host=127.0.0.1", fmt.Sprintf("--port=%d", port),
			"--testing", "--store_on_disk=false", "--consistency=1.0",
		}, HTTPReady)
		if datastoreErr == nil {
			datastoreAddr = addr
			os.Setenv("DATASTORE_EMULATOR_HOST", addr)
		}
	})
	if datastoreErr != nil {
		t.Fatal(datastoreErr)
	}
	return datastoreAddr
}
