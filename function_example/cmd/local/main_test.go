package main

import (
	"bytes"
	"errors"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
)

// runAsMain makes the test binary run the command itself, so that each
// test runs it in a process of its own (the functions framework's
// registry takes a function's name once per process).
const runAsMain = "ORDERS_LOCAL_TEST_RUN_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(runAsMain) == "1" {
		main()
		os.Exit(0)
	}
	code := m.Run()
	testsvc.StopAll()
	os.Exit(code)
}

// command runs the command with args, in the test's environment plus env.
func command(t *testing.T, env []string, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), os.Args[0], args...)
	cmd.Env = append(append(os.Environ(), runAsMain+"=1"), env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err = cmd.Run()
	return out.String(), errb.String(), err
}

const suppressed = "received order PO-1001 1 time(s) from 3 deliveries: the duplicates were suppressed"

// A workstation's environment names a real store, a Cloud Run service,
// an emulator and a metadata server, all at a listener that counts who
// connects: the demo runs on the in-memory store all the same, and none of
// them is dialed.
func TestDemoRunsInMemoryWhateverTheEnvironmentSays(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var dialed atomic.Int32
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			dialed.Add(1)
			c.Close()
		}
	}()
	addr := ln.Addr().String()
	hostile := []string{
		"IDEMPOTENCY_BACKEND=datastore", "GOOGLE_CLOUD_PROJECT=my-workstation-project", "DATASTORE_PROJECT_ID=my-workstation-project",
		"DATASTORE_EMULATOR_HOST=" + addr, "GCE_METADATA_HOST=" + addr, "K_SERVICE=orders",
		"REDIS_ADDR=" + addr, "POSTGRES_DSN=postgres://u@" + addr + "/db?connect_timeout=1",
		"IDEMPOTENCY_LEASE=not-a-duration", "IDEMPOTENCY_ALLOW_MEMORY_ON_CLOUD_RUN=maybe",
	}
	for _, args := range [][]string{nil, {"-backend=memory"}} {
		out, errOut, err := command(t, hostile, args...)
		if err != nil || !strings.Contains(out, suppressed) || !strings.Contains(out, "(in-memory store)") {
			t.Fatalf("args %q: %v\nstdout:\n%s\nstderr:\n%s", args, err, out, errOut)
		}
	}
	if n := dialed.Load(); n != 0 {
		t.Fatalf("the demo dialed the environment's stores %d times", n)
	}
}

// A real store only by the flag, and then the demo still sends the order
// once; a second run sends an order of its own rather than finding the
// first run's records.
func TestDemoOnARealStoreByTheFlag(t *testing.T) {
	for _, c := range []struct {
		flag, describe string
		env            func(t *testing.T) string
	}{
		{"-backend=redis", "(Redis, REDIS_ADDR)", func(t *testing.T) string { return "REDIS_ADDR=" + testsvc.Redis(t) }},
		{"-backend=postgres", "(PostgreSQL, POSTGRES_DSN)", func(t *testing.T) string { return "POSTGRES_DSN=" + testsvc.Postgres(t) }},
	} {
		t.Run(c.flag, func(t *testing.T) {
			env := []string{c.env(t), "IDEMPOTENCY_BACKEND=memory"}
			for run := range 2 {
				out, errOut, err := command(t, env, c.flag)
				if err != nil || !strings.Contains(out, c.describe) ||
					!strings.Contains(out, "1 time(s) from 3 deliveries: the duplicates were suppressed") {
					t.Fatalf("run %d: %v\nstdout:\n%s\nstderr:\n%s", run+1, err, out, errOut)
				}
			}
		})
	}
}

// A flag naming a store without its setting, or no store, fails before
// anything is served, and says what is missing.
func TestDemoRefusesABackendFlagItCannotHonour(t *testing.T) {
	unset := []string{"REDIS_ADDR=", "POSTGRES_DSN=", "GOOGLE_CLOUD_PROJECT=", "DATASTORE_PROJECT_ID="}
	for _, c := range []struct {
		args []string
		say  string
		code int
	}{
		{[]string{"-backend=redis"}, "REDIS_ADDR", 1},
		{[]string{"-backend=postgres"}, "POSTGRES_DSN", 1},
		{[]string{"-backend=datastore"}, "GOOGLE_CLOUD_PROJECT", 1},
		{[]string{"-backend=sqlite"}, "want datastore, redis, postgres or memory", 1},
		{[]string{"-lease=0s"}, "-lease", 1},
		{[]string{"-store=redis"}, "usage: local [-backend=memory|redis|postgres|datastore]", 2},
		{[]string{"redis"}, `unexpected argument "redis"`, 2},
	} {
		out, errOut, err := command(t, unset, c.args...)
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != c.code || !strings.Contains(errOut, c.say) || strings.Contains(out, "serving") {
			t.Errorf("args %q: %v, want exit %d saying %q\nstdout:\n%s\nstderr:\n%s", c.args, err, c.code, c.say, out, errOut)
		}
	}
}
