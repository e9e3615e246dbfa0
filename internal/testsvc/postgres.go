package testsvc

import (
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
)

const postgresHow = "install PostgreSQL (initdb and postgres on PATH or in /usr/local/bin or /usr/lib/postgresql/*/bin) or set POSTGRES_DSN"

// findPostgres finds initdb and postgres side by side: on PATH, in
// /usr/local/bin, or in Debian's newest /usr/lib/postgresql/*/bin.
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

// lookPostgres is findPostgres, skipping or failing t when PostgreSQL is
// not installed.
func lookPostgres(t testing.TB) (initdb, postgres string) {
	t.Helper()
	initdb, postgres, ok := findPostgres()
	if !ok {
		Missing(t, "PostgreSQL", postgresHow)
	}
	return initdb, postgres
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
// postgres. The server is killed and its files deleted when t ends.
func StartPostgres(t testing.TB) (*Process, string) {
	t.Helper()
	initdb, postgres := lookPostgres(t)
	// Not t.TempDir: its parent is private to root, and the server runs as
	// the postgres user.
	dir, err := os.MkdirTemp("", "testsvc-postgres-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	p, dsn, err := startPostgres(initdb, postgres, dir)
	return own(t, p, err), dsn
}

// startPostgres runs initdb in dir/data and starts postgres on it, both as
// the postgres user when this process is root, with env (KEY=value) added
// to the server's environment.
func startPostgres(initdb, postgres, dir string, env ...string) (*Process, string, error) {
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
	port, addr, err := freeAddr()
	if err != nil {
		return nil, "", err
	}
	p := &Process{Name: "postgres", Addr: addr, bin: postgres, dir: dir, args: []string{
		"-D", data, "-p", fmt.Sprint(port), "-c", "listen_addresses=127.0.0.1",
		"-c", "unix_socket_directories=" + dir, "-c", "fsync=off", "-c", "max_connections=200",
	}}
	p.prepare = func(cmd *exec.Cmd) error {
		if len(env) > 0 {
			cmd.Env = append(os.Environ(), env...)
		}
		return asUser(cmd, "postgres", dir)
	}
	if _, err := p.launch(PostgresReady); err != nil {
		return nil, "", err
	}
	return p, fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable", addr), nil
}

var sharedPostgres shared

// Postgres returns a DSN for a PostgreSQL server shared by the whole test
// binary: POSTGRES_DSN when set, else one it starts. Tests sharing it must
// use tables or databases of their own.
func Postgres(t testing.TB) string {
	t.Helper()
	if dsn := os.Getenv("POSTGRES_DSN"); dsn != "" {
		return dsn
	}
	initdb, postgres := lookPostgres(t)
	return sharedPostgres.get(t, "testsvc-postgres-", func(dir string) (*Process, string, error) {
		return startPostgres(initdb, postgres, dir)
	})
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
