package testsvc

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

const faketimeHow = "install libfaketime (Debian: apt-get install libfaketime; scripts/install-services.sh does)"

// findFaketime finds libfaketime's preload library.
func findFaketime() (string, bool) {
	var candidates []string
	for _, g := range []string{"/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1", "/usr/local/lib/faketime/libfaketime.so.1"} {
		m, _ := filepath.Glob(g)
		candidates = append(candidates, m...)
	}
	for _, c := range candidates {
		if _, err := os.Stat(c); err == nil {
			return c, true
		}
	}
	return "", false
}

// FakeClock is the wall clock of a server started under libfaketime: its
// offset from this machine's clock is a file the server rereads on every
// clock reading, so a jump takes effect at once, while the server runs. Only
// the wall clock moves (CLOCK_REALTIME and friends); the server's monotonic
// clock runs on, as in a real step of a system clock.
type FakeClock struct {
	lib, file string

	hold sync.Mutex // held by the test that has the server

	mu  sync.Mutex
	off time.Duration
}

// newFakeClock returns a clock at this machine's time whose offset file
// lives in dir (which a server running as another user can read).
func newFakeClock(lib, dir string) (*FakeClock, error) {
	c := &FakeClock{lib: lib, file: filepath.Join(dir, "faketime.rc")}
	return c, c.write()
}

// env is the environment that starts a server on c.
func (c *FakeClock) env() []string {
	return []string{
		"LD_PRELOAD=" + c.lib,
		"FAKETIME_TIMESTAMP_FILE=" + c.file,
		"FAKETIME_NO_CACHE=1",
		"FAKETIME_DONT_FAKE_MONOTONIC=1",
	}
}

// write stores the offset, atomically (a server reads the file at any
// moment), as libfaketime's relative offset in seconds.
func (c *FakeClock) write() error {
	tmp := c.file + ".new"
	if err := os.WriteFile(tmp, fmt.Appendf(nil, "%+.9f\n", c.off.Seconds()), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, c.file)
}

// Jump moves the server's wall clock by d: ahead when d > 0, behind when
// d < 0.
func (c *FakeClock) Jump(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.off += d
	if err := c.write(); err != nil {
		panic(fmt.Sprintf("testsvc: moving the server's clock: %v", err))
	}
}

// Now reads the server's wall clock: this machine's, plus every jump.
func (c *FakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return time.Now().Add(c.off)
}

// take gives the server to t until it ends: other callers wait, and at the
// end its clock is back to this machine's.
func (c *FakeClock) take(t testing.TB) {
	c.hold.Lock()
	t.Cleanup(func() {
		c.mu.Lock()
		c.off = 0
		err := c.write()
		c.mu.Unlock()
		c.hold.Unlock()
		if err != nil {
			t.Errorf("testsvc: resetting the server's clock: %v", err)
		}
	})
}

// fakeClockServer is a server of the test binary's own, started at most
// once, under libfaketime.
type fakeClockServer struct {
	shared
	clock *FakeClock
}

func (s *fakeClockServer) get(t testing.TB, prefix string, start func(dir string, env []string) (*Process, string, error)) (string, *FakeClock) {
	t.Helper()
	lib, ok := findFaketime()
	if !ok {
		Missing(t, "libfaketime", faketimeHow)
	}
	dsn := s.shared.get(t, prefix, func(dir string) (*Process, string, error) {
		c, err := newFakeClock(lib, dir)
		if err != nil {
			return nil, "", err
		}
		s.clock = c
		return start(dir, c.env())
	})
	s.clock.take(t)
	return dsn, s.clock
}

var postgresFake, mariaDBFake fakeClockServer

// PostgresOnFakeClock returns a DSN (user postgres, database postgres) for a
// PostgreSQL server whose wall clock the test moves with the FakeClock it
// also returns: a server of the test binary's own, started under
// libfaketime on first use. The test has it to itself until it ends (other
// callers wait), and leaves its clock back at this machine's time.
func PostgresOnFakeClock(t testing.TB) (string, *FakeClock) {
	t.Helper()
	initdb, postgres := lookPostgres(t)
	return postgresFake.get(t, "testsvc-postgres-faketime-", func(dir string, env []string) (*Process, string, error) {
		return startPostgres(initdb, postgres, dir, env...)
	})
}

// MariaDBOnFakeClock is [PostgresOnFakeClock] for MariaDB: it returns a
// go-sql-driver/mysql DSN for root, without a database name.
func MariaDBOnFakeClock(t testing.TB) (string, *FakeClock) {
	t.Helper()
	bin := lookMariaDB(t)
	return mariaDBFake.get(t, "testsvc-mariadb-faketime-", func(dir string, env []string) (*Process, string, error) {
		return startMariaDB(bin, dir, env...)
	})
}
