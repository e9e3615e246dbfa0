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
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
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
	// prepare adjusts the command before each start (for example to run
	// it as another user).
	prepare func(*exec.Cmd) error
	// removeDir: StopAll deletes dir (a shared instance's temp dir).
	removeDir bool
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
		if p.removeDir {
			os.RemoveAll(p.dir)
		}
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
		p.removeDir = true
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
		var p *Process
		p, datastoreErr = Start("datastore-emulator", DatastoreEmulator, dir, addr, []string{
			"start", "--host=127.0.0.1", fmt.Sprintf("--port=%d", port),
			"--testing", "--store_on_disk=false", "--consistency=1.0",
		}, HTTPReady)
		if datastoreErr == nil {
			p.removeDir = true
			datastoreAddr = addr
			os.Setenv("DATASTORE_EMULATOR_HOST", addr)
		}
	})
	if datastoreErr != nil {
		t.Fatal(datastoreErr)
	}
	return datastoreAddr
}

// asUser makes cmd run as the named user when this process is root (the
// database servers refuse to run as root), and hands it dir.
func asUser(cmd *exec.Cmd, name, dir string) error {
	if os.Geteuid() != 0 {
		return nil
	}
	u, err := user.Lookup(name)
	if err != nil {
		return fmt.Errorf("running as root needs a %q user: %w", name, err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	return filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Chown(p, uid, gid)
	})
}

const postgresHow = "install PostgreSQL (initdb and postgres on PATH or in /usr/local/bin or /usr/lib/postgresql/*/bin) or set POSTGRES_DSN"

func findPostgres() (initdb, postgres string, ok bool) {
	dirs := []string{""}
	dirs = append(dirs, "/usr/local/bin")
	if m, _ := filepath.Glob("/usr/lib/postgresql/*/bin"); len(m) > 0 {
		dirs = append(dirs, m[len(m)-1])
	}
	for _, d := range dirs {
		var i, p string
		if d == "" {
			i, _ = exec.LookPath("initdb")
			p, _ = exec.LookPath("postgres")
		} else {
			i, p = filepath.Join(d, "initdb"), filepath.Join(d, "postgres")
		}
		if i != "" && p != "" {
			if _, err := os.Stat(i); err == nil {
				if _, err := os.Stat(p); err == nil {
					return i, p, true
				}
			}
		}
	}
	return "", "", false
}

// PostgresReady answers whether a PostgreSQL server on addr accepts a
// session for user postgres (trust authentication): a server still starting
// up or recovering answers the startup message with an error.
func PostgresReady(addr string) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	// A StartupMessage, protocol 3.0: the server answers 'R' (an
	// authentication request, or AuthenticationOk under trust) when it takes
	// sessions, 'E' (for example 57P03, starting up) when not.
	params := "user\x00postgres\x00database\x00postgres\x00\x00"
	msg := binary.BigEndian.AppendUint32(nil, uint32(8+len(params)))
	msg = binary.BigEndian.AppendUint32(msg, 3<<16)
	msg = append(msg, params...)
	if _, err := c.Write(msg); err != nil {
		return err
	}
	b := make([]byte, 512)
	n, err := c.Read(b)
	if err != nil {
		return err
	}
	if b[0] != 'R' {
		return fmt.Errorf("startup answered %q", b[:n])
	}
	c.Write([]byte{'X', 0, 0, 0, 4}) // Terminate
	return nil
}

// StartPostgres initializes a PostgreSQL cluster of its own for t and
// starts it; it returns the process and a DSN for user postgres, database
// postgres. The server stops when t ends.
func StartPostgres(t testing.TB) (*Process, string) {
	t.Helper()
	initdb, postgres, ok := findPostgres()
	if !ok {
		Missing(t, "PostgreSQL", postgresHow)
	}
	// Not t.TempDir: its parent is private to root, and the server runs as
	// the postgres user.
	dir, err := os.MkdirTemp("", "testsvc-postgres-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	p, dsn, err := startPostgres(initdb, postgres, dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return p, dsn
}

func startPostgres(initdb, postgres, dir string) (*Process, string, error) {
	if err := os.Chmod(dir, 0o755); err != nil {
		return nil, "", err
	}
	data := filepath.Join(dir, "data")
	cmd := exec.Command(initdb, "-D", data, "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
	if err := asUser(cmd, "postgres", dir); err != nil {
		return nil, "", err
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, "", fmt.Errorf("initdb: %v\n%s", err, out)
	}
	port, err := FreePort()
	if err != nil {
		return nil, "", err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	p := &Process{Name: "postgres", Addr: addr, bin: postgres, dir: dir, args: []string{
		"-D", data, "-p", fmt.Sprint(port), "-c", "listen_addresses=127.0.0.1",
		"-c", "unix_socket_directories=" + dir, "-c", "fsync=off", "-c", "max_connections=200",
	}}
	p.prepare = func(cmd *exec.Cmd) error { return asUser(cmd, "postgres", dir) }
	if err := p.start(PostgresReady); err != nil {
		return nil, "", err
	}
	mu.Lock()
	running = append(running, p)
	mu.Unlock()
	return p, fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable", addr), nil
}

var (
	sharedPGOnce sync.Once
	sharedPG     string
	sharedPGErr  error
)

// Postgres returns a DSN for a PostgreSQL server shared by the whole test
// binary: POSTGRES_DSN when set, else one it starts.
func Postgres(t testing.TB) string {
	t.Helper()
	if dsn := os.Getenv("POSTGRES_DSN"); dsn != "" {
		return dsn
	}
	initdb, postgres, ok := findPostgres()
	if !ok {
		Missing(t, "PostgreSQL", postgresHow)
	}
	sharedPGOnce.Do(func() {
		dir, err := os.MkdirTemp("", "testsvc-postgres-")
		if err != nil {
			sharedPGErr = err
			return
		}
		var p *Process
		p, sharedPG, sharedPGErr = startPostgres(initdb, postgres, dir)
		if p != nil {
			p.removeDir = true
		}
	})
	if sharedPGErr != nil {
		t.Fatal(sharedPGErr)
	}
	return sharedPG
}

const mariadbHow = "install Debian's mariadb-server (apt-get install -y mariadb-server) or set MYSQL_DSN"

// MySQLReady answers whether a MySQL/MariaDB server sends its greeting.
func MySQLReady(addr string) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	b := make([]byte, 5)
	_, err = io.ReadFull(c, b)
	return err
}

// StartMariaDB starts a MariaDB server of its own for t, with a database
// "test", and returns it and a go-sql-driver/mysql DSN for root.
func StartMariaDB(t testing.TB) (*Process, string) {
	t.Helper()
	bin, err := exec.LookPath("mariadbd")
	if err != nil {
		if bin, err = exec.LookPath("/usr/sbin/mariadbd"); err != nil {
			Missing(t, "mariadbd", mariadbHow)
		}
	}
	p, dsn, err := startMariaDB(bin, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return p, dsn
}

// startMariaDB installs a data directory under dir and starts mariadbd on
// it, with env (KEY=value) added to the server's environment.
func startMariaDB(bin, dir string, env ...string) (*Process, string, error) {
	install, err := exec.LookPath("mariadb-install-db")
	if err != nil {
		return nil, "", fmt.Errorf("mariadb-install-db: %w", err)
	}
	data := filepath.Join(dir, "data")
	user := "mysql"
	if os.Geteuid() != 0 {
		user = ""
	}
	args := []string{"--no-defaults", "--datadir=" + data, "--auth-root-authentication-method=normal", "--skip-test-db"}
	if user != "" {
		args = append(args, "--user=root")
	}
	if out, err := exec.Command(install, args...).CombinedOutput(); err != nil {
		return nil, "", fmt.Errorf("mariadb-install-db: %v\n%s", err, out)
	}
	port, err := FreePort()
	if err != nil {
		return nil, "", err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	srvArgs := []string{
		"--no-defaults", "--datadir=" + data, "--socket=" + filepath.Join(dir, "sock"),
		fmt.Sprintf("--port=%d", port), "--bind-address=127.0.0.1", "--skip-log-bin",
		"--innodb-flush-log-at-trx-commit=2", "--max-connections=300", "--skip-name-resolve",
	}
	if user != "" {
		srvArgs = append(srvArgs, "--user=root")
	}
	p := &Process{Name: "mariadb", Addr: addr, args: srvArgs, bin: bin, dir: dir}
	if len(env) > 0 {
		p.prepare = func(cmd *exec.Cmd) error {
			cmd.Env = append(os.Environ(), env...)
			return nil
		}
	}
	if err := p.start(MySQLReady); err != nil {
		return nil, "", err
	}
	mu.Lock()
	running = append(running, p)
	mu.Unlock()
	// Create the test database over the wire once the server accepts.
	return p, fmt.Sprintf("root@tcp(%s)/", addr), nil
}

// StartMariaDBInZone is StartMariaDB with the server's process in the time
// zone zone (its TZ, for example "Europe/Berlin"): sessions on the default
// time_zone SYSTEM then observe that zone's daylight-saving changes, as on a
// self-managed server whose host has a local zone.
func StartMariaDBInZone(t testing.TB, zone string) (*Process, string) {
	t.Helper()
	bin, err := exec.LookPath("mariadbd")
	if err != nil {
		if bin, err = exec.LookPath("/usr/sbin/mariadbd"); err != nil {
			Missing(t, "mariadbd", mariadbHow)
		}
	}
	p, dsn, err := startMariaDB(bin, t.TempDir(), "TZ="+zone)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return p, dsn
}

var (
	sharedMariaOnce sync.Once
	sharedMaria     string
	sharedMariaErr  error
)

// MariaDB returns a go-sql-driver/mysql DSN (without a database name) for
// a MariaDB server shared by the whole test binary: MYSQL_DSN when set,
// else one it starts.
func MariaDB(t testing.TB) string {
	t.Helper()
	if dsn := os.Getenv("MYSQL_DSN"); dsn != "" {
		return dsn
	}
	bin, err := exec.LookPath("mariadbd")
	if err != nil {
		if bin, err = exec.LookPath("/usr/sbin/mariadbd"); err != nil {
			Missing(t, "mariadbd", mariadbHow)
		}
	}
	sharedMariaOnce.Do(func() {
		dir, err := os.MkdirTemp("", "testsvc-mariadb-")
		if err != nil {
			sharedMariaErr = err
			return
		}
		var p *Process
		p, sharedMaria, sharedMariaErr = startMariaDB(bin, dir)
		if p != nil {
			p.removeDir = true
		}
	})
	if sharedMariaErr != nil {
		t.Fatal(sharedMariaErr)
	}
	return sharedMaria
}

// PubSubEmulator is where the gcloud SDK keeps the Pub/Sub emulator.
const PubSubEmulator = "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator"

var (
	pubsubOnce sync.Once
	pubsubAddr string
	pubsubErr  error
)

// PubSub returns the host:port of a Pub/Sub emulator shared by the whole
// test binary: PUBSUB_EMULATOR_HOST when set, else one it starts. Tests
// sharing it must use projects or topics of their own.
func PubSub(t testing.TB) string {
	t.Helper()
	if addr := os.Getenv("PUBSUB_EMULATOR_HOST"); addr != "" && pubsubAddr == "" {
		return addr
	}
	if _, err := os.Stat(PubSubEmulator); err != nil {
		Missing(t, "the Pub/Sub emulator", "install the Google Cloud SDK's pubsub-emulator (and a Java runtime), or set PUBSUB_EMULATOR_HOST")
	}
	pubsubOnce.Do(func() {
		dir, err := os.MkdirTemp("", "testsvc-pubsub-")
		if err != nil {
			pubsubErr = err
			return
		}
		port, err := FreePort()
		if err != nil {
			pubsubErr = err
			return
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		var p *Process
		p, pubsubErr = Start("pubsub-emulator", PubSubEmulator, dir, addr,
			[]string{"--host=127.0.0.1", fmt.Sprintf("--port=%d", port)}, HTTPReady)
		if pubsubErr == nil {
			p.removeDir = true
			pubsubAddr = addr
		}
	})
	if pubsubErr != nil {
		t.Fatal(pubsubErr)
	}
	return pubsubAddr
}

// StartRedisCluster starts a three-master Redis Cluster of its own for t
// and returns its nodes' addresses once the cluster reports ok.
func StartRedisCluster(t testing.TB) []string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		Missing(t, "redis-server", redisHow)
	}
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		Missing(t, "redis-cli", redisHow)
	}
	var addrs []string
	for range 3 {
		p, err := startRedis(bin, t.TempDir(), []string{"--cluster-enabled", "yes", "--cluster-node-timeout", "2000"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Kill)
		addrs = append(addrs, p.Addr)
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		ok := true
		for _, a := range addrs {
			host, port, _ := net.SplitHostPort(a)
			out, _ := exec.Command(cli, "-h", host, "-p", port, "cluster", "info").Output()
			ok = ok && strings.Contains(string(out), "cluster_state:ok")
		}
		if ok {
			return addrs
		}
		if time.Now().After(deadline) {
			t.Fatal("the Redis Cluster did not reach cluster_state:ok within 30s")
		}
		time.Sleep(100 * time.Millisecond)
	}
}
