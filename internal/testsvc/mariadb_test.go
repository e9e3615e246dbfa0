package testsvc

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

func TestMariaDBIsSharedAndAnswers(t *testing.T) {
	t.Parallel()
	a, b := MariaDB(t), MariaDB(t)
	if a != b {
		t.Fatalf("MariaDB returned %q, then %q", a, b)
	}
	_, rest, ok := strings.Cut(a, "tcp(")
	addr, _, ok2 := strings.Cut(rest, ")")
	if !ok || !ok2 {
		t.Fatalf("DSN %q: no tcp(host:port)", a)
	}
	if err := MySQLReady(addr); err != nil {
		t.Fatal(err)
	}
}

// The zone reaches the server's environment, and survives a restart.
func TestStartMariaDBInZone(t *testing.T) {
	t.Parallel()
	p, dsn := StartMariaDBInZone(t, "Europe/Berlin")
	if dsn != fmt.Sprintf("root@tcp(%s)/", p.Addr) {
		t.Fatalf("DSN %q does not point at %s", dsn, p.Addr)
	}
	inZone := func() bool {
		env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", p.cmd.Process.Pid))
		if err != nil {
			t.Fatal(err)
		}
		return strings.Contains("\x00"+string(env)+"\x00", "\x00TZ=Europe/Berlin\x00")
	}
	if !inZone() {
		t.Fatal("the server's environment has no TZ=Europe/Berlin")
	}
	restart(t, p, MySQLReady)
	if !inZone() {
		t.Fatal("after Restart, the server's environment has no TZ=Europe/Berlin")
	}
}
