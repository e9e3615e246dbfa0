package testsvc

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
)

func TestMain(m *testing.M) {
	if IsRaceChild() {
		os.Exit(RaceChild(fake.New()))
	}
	code := m.Run()
	StopAll()
	os.Exit(code)
}

// A process that dies before it is ready is reported with its log's tail,
// not waited on for 30s.
func TestStartReportsAProcessThatExitsBeforeReady(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	start := time.Now()
	_, err := Start("doomed", "/bin/sh", dir, "127.0.0.1:1", []string{"-c", "echo the reason it died; exit 3"},
		func(string) error { return errors.New("not yet") })
	if err == nil || !strings.Contains(err.Error(), "exited before it was ready") || !strings.Contains(err.Error(), "the reason it died") {
		t.Fatalf("err = %v, want the exit and the log's tail", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("took %v to notice the exit", d)
	}
}

// Kill ends the whole tree, a child that left the process group included
// (its connections must die with the server); Restart runs the same command
// again.
func TestKillEndsTheTreeAndRestartRunsAgain(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "child.pid")
	ready := func(string) error {
		if _, err := os.Stat(pidFile); err != nil {
			return err
		}
		return nil
	}
	p, err := Start("tree", "/bin/sh", dir, "127.0.0.1:1",
		[]string{"-c", "setsid sleep 300 & echo $! > child.pid.tmp; mv child.pid.tmp child.pid; exec sleep 300"}, ready)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	child := readPid(t, pidFile)
	if !alive(child) {
		t.Fatalf("the child %d is not running", child)
	}
	p.Kill()
	// SIGKILL is delivered asynchronously: a process that was sent it may
	// still be listed as running for a moment (CI saw the child so on a
	// loaded machine), so wait a bounded time for the kernel to end it.
	if gone(p.cmd.Process.Pid) != nil || gone(child) != nil {
		t.Fatalf("after Kill: server alive %v, child alive %v", alive(p.cmd.Process.Pid), alive(child))
	}
	os.Remove(pidFile)
	if err := p.Restart(ready); err != nil {
		t.Fatal(err)
	}
	if again := readPid(t, pidFile); again == child || !alive(again) {
		t.Fatalf("after Restart: child %d (was %d), alive %v", again, child, alive(again))
	}
	if !alive(p.cmd.Process.Pid) {
		t.Fatal("the restarted process is not running")
	}
}

func readPid(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// gone waits up to 10s for pid to stop running, and returns an error if
// it still runs then.
func gone(pid int) error {
	for deadline := time.Now().Add(10 * time.Second); alive(pid); {
		if time.Now().After(deadline) {
			return fmt.Errorf("process %d still runs", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

// alive reports whether pid runs (a zombie left for init to reap does not).
func alive(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	return len(fields) > 0 && fields[0] != "Z" && fields[0] != "X"
}

// tb records what Missing does instead of ending the test; like
// testing.T, Fatalf and Skipf end the goroutine that calls them.
type tb struct {
	testing.TB
	fatal, skip string
}

func (r *tb) Helper() {}

func (r *tb) Fatalf(format string, args ...any) {
	r.fatal = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func (r *tb) Skipf(format string, args ...any) {
	r.skip = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// missing runs Missing on r in a goroutine of its own, as Goexit needs.
func missing(r *tb, service, how string) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		Missing(r, service, how)
	}()
	<-done
}

// A missing service skips the test, but fails it where services are
// required, so that no backend passes by being skipped.
func TestMissingSkipsUnlessRequired(t *testing.T) {
	for _, tc := range []struct {
		ci, require string
		fails       bool
	}{
		{"", "", false},
		{"true", "", true},
		{"", "1", true},
		{"false", "0", false},
	} {
		t.Setenv("CI", tc.ci)
		t.Setenv("IDEMPOTENCY_REQUIRE_SERVICES", tc.require)
		r := &tb{TB: t}
		missing(r, "the-service", "install it")
		if Required() != tc.fails {
			t.Errorf("CI=%q IDEMPOTENCY_REQUIRE_SERVICES=%q: Required() = %v, want %v", tc.ci, tc.require, Required(), tc.fails)
		}
		got := r.skip
		if tc.fails {
			got = r.fatal
		}
		if got == "" || (tc.fails && r.skip != "") || (!tc.fails && r.fatal != "") {
			t.Errorf("CI=%q IDEMPOTENCY_REQUIRE_SERVICES=%q: fatal %q, skip %q; want only a %s",
				tc.ci, tc.require, r.fatal, r.skip, map[bool]string{true: "failure", false: "skip"}[tc.fails])
		}
		if !strings.Contains(got, "the-service") || !strings.Contains(got, "install it") {
			t.Errorf("message %q does not name the service and how to get it", got)
		}
	}
}

func TestFreePortIsFreeOnLoopback(t *testing.T) {
	t.Parallel()
	port, addr, err := freeAddr()
	if err != nil {
		t.Fatal(err)
	}
	if port <= 0 || addr != fmt.Sprintf("127.0.0.1:%d", port) {
		t.Fatalf("freeAddr() = %d, %q", port, addr)
	}
}

// Outside hands back what a service function returns, or, when it skips or
// fails, its reason, and ends only the service function's goroutine.
func TestOutsideReportsTheAddressOrTheReason(t *testing.T) {
	if addr, why := Outside(func(testing.TB) string { return "127.0.0.1:1" }); addr != "127.0.0.1:1" || why != "" {
		t.Errorf("a service that answered: got %q, %q", addr, why)
	}
	for name, stop := range map[string]func(testing.TB){
		"skip":  func(tb testing.TB) { tb.Helper(); tb.Skipf("no %s here", "postgres") },
		"fatal": func(tb testing.TB) { tb.Fatal("no postgres here") },
	} {
		after := false
		addr, why := Outside(func(tb testing.TB) string {
			stop(tb)
			after = true
			return "unreachable"
		})
		if addr != "" || why != "no postgres here" || after {
			t.Errorf("%s: got %q, %q, ran on after it: %v", name, addr, why, after)
		}
	}
}
