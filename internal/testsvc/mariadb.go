package testsvc

import (
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

const mariadbHow = "install Debian's mariadb-server (apt-get install -y mariadb-server) or set MYSQL_DSN"

// MySQLReady answers whether a MySQL/MariaDB server on addr sends its
// greeting.
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

// lookMariaDB returns the path of mariadbd (on PATH or in /usr/sbin), or
// skips or fails t without it.
func lookMariaDB(t testing.TB) string {
	t.Helper()
	bin, err := exec.LookPath("mariadbd")
	if err != nil {
		if bin, err = exec.LookPath("/usr/sbin/mariadbd"); err != nil {
			Missing(t, "mariadbd", mariadbHow)
		}
	}
	return bin
}

// StartMariaDB starts a MariaDB server of its own for t and returns it and
// a go-sql-driver/mysql DSN for root, without a database name. The server
// is killed when t ends.
func StartMariaDB(t testing.TB) (*Process, string) {
	t.Helper()
	p, dsn, err := startMariaDB(lookMariaDB(t), t.TempDir())
	return own(t, p, err), dsn
}

// StartMariaDBInZone is [StartMariaDB] with the server's process in the
// time zone zone (its TZ, for example "Europe/Berlin"): sessions on the
// default time_zone SYSTEM then observe that zone's daylight-saving changes,
// as on a self-managed server whose host has a local zone.
func StartMariaDBInZone(t testing.TB, zone string) (*Process, string) {
	t.Helper()
	p, dsn, err := startMariaDB(lookMariaDB(t), t.TempDir(), "TZ="+zone)
	return own(t, p, err), dsn
}

// startMariaDB installs a data directory under dir and starts mariadbd on
// it, with env (KEY=value) added to the server's environment.
func startMariaDB(bin, dir string, env ...string) (*Process, string, error) {
	install, err := exec.LookPath("mariadb-install-db")
	if err != nil {
		return nil, "", fmt.Errorf("mariadb-install-db: %w", err)
	}
	data := filepath.Join(dir, "data")
	// Each instance has a temporary directory of its own: with the default
	// (/tmp) the bootstrap's internal temporary tables of one instance and
	// another's met in CI (mariadb-install-db failed with "Unknown table
	// 'mysql.tmp_user_sys'" after "Could not remove temporary table").
	tmp := filepath.Join(dir, "tmp")
	if err := os.MkdirAll(tmp, 0o700); err != nil {
		return nil, "", err
	}
	asRoot := os.Geteuid() == 0
	args := []string{"--no-defaults", "--datadir=" + data, "--tmpdir=" + tmp, "--auth-root-authentication-method=normal", "--skip-test-db"}
	if asRoot {
		args = append(args, "--user=root")
	}
	var out []byte
	for attempt := 1; ; attempt++ {
		cmd := exec.Command(install, args...)
		cmd.Env = append(os.Environ(), "TMPDIR="+tmp)
		if out, err = cmd.CombinedOutput(); err == nil {
			break
		}
		if attempt == 3 {
			return nil, "", fmt.Errorf("mariadb-install-db (%d attempts): %v\n%s", attempt, err, out)
		}
		// A failed bootstrap leaves a partial data directory, which the
		// next attempt would refuse.
		if rmErr := os.RemoveAll(data); rmErr != nil {
			return nil, "", fmt.Errorf("mariadb-install-db: %v\n%s\n(removing the partial data directory: %v)", err, out, rmErr)
		}
	}
	port, addr, err := freeAddr()
	if err != nil {
		return nil, "", err
	}
	srvArgs := []string{
		"--no-defaults", "--datadir=" + data, "--tmpdir=" + tmp, "--socket=" + filepath.Join(dir, "sock"),
		fmt.Sprintf("--port=%d", port), "--bind-address=127.0.0.1", "--skip-log-bin",
		"--innodb-flush-log-at-trx-commit=2", "--max-connections=300", "--skip-name-resolve",
	}
	if asRoot {
		srvArgs = append(srvArgs, "--user=root")
	}
	p := &Process{Name: "mariadb", Addr: addr, args: srvArgs, bin: bin, dir: dir}
	if len(env) > 0 {
		p.prepare = func(cmd *exec.Cmd) error {
			cmd.Env = append(os.Environ(), env...)
			return nil
		}
	}
	if _, err := p.launch(MySQLReady); err != nil {
		return nil, "", err
	}
	return p, fmt.Sprintf("root@tcp(%s)/", addr), nil
}

var sharedMariaDB shared

// MariaDB returns a go-sql-driver/mysql DSN (without a database name) for
// a MariaDB server shared by the whole test binary: MYSQL_DSN when set,
// else one it starts. Tests sharing it must use databases of their own.
func MariaDB(t testing.TB) string {
	t.Helper()
	if dsn := os.Getenv("MYSQL_DSN"); dsn != "" {
		return dsn
	}
	bin := lookMariaDB(t)
	return sharedMariaDB.get(t, "testsvc-mariadb-", func(dir string) (*Process, string, error) {
		return startMariaDB(bin, dir)
	})
}
