package testsvc

import (
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The emulator answers, clients in this process find it through
// SPANNER_EMULATOR_HOST, its instance exists, and a test's database is
// created with its DDL and dropped at the end.
func TestSpannerAnswersAndMakesDatabases(t *testing.T) {
	addr := Spanner(t)
	if got := os.Getenv("SPANNER_EMULATOR_HOST"); got != addr {
		t.Fatalf("SPANNER_EMULATOR_HOST = %q, want %q", got, addr)
	}
	if again := Spanner(t); again != addr {
		t.Fatalf("Spanner returned %q, then %q", addr, again)
	}
	var name string
	t.Run("database", func(t *testing.T) {
		name = SpannerDatabase(t, "CREATE TABLE T (k INT64 NOT NULL) PRIMARY KEY (k)")
		if !strings.HasPrefix(name, SpannerInstance+"/databases/") {
			t.Fatalf("database name %q", name)
		}
		ddl, err := spannerCall("GET", spannerREST, "/v1/"+name+"/ddl", nil)
		if err != nil || !strings.Contains(string(ddl), "CREATE TABLE T") {
			t.Fatalf("the database's DDL: %s, %v", ddl, err)
		}
	})
	if _, err := spannerCall("GET", spannerREST, "/v1/"+name, nil); err == nil {
		t.Fatalf("database %s outlived its test", name)
	}
}

// An emulator of the test's own dies with its child emulator_main, and
// restarts on the same address.
func TestStartSpannerKillEndsTheWholeTree(t *testing.T) {
	p, rest := StartSpanner(t)
	kids := descendants(p.cmd.Process.Pid)
	if len(kids) == 0 {
		t.Fatal("gateway_main started no emulator_main")
	}
	p.Kill()
	// SIGKILL is delivered asynchronously: a child may still be running
	// for a moment after Kill returns, so each gets a few seconds to die
	// (gone, or a zombie awaiting its reaper).
	alive := func(pid int) bool {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		return err == nil && !strings.Contains(string(b), ") Z ")
	}
	for _, pid := range kids {
		for deadline := time.Now().Add(10 * time.Second); alive(pid) && time.Now().Before(deadline); {
			time.Sleep(20 * time.Millisecond)
		}
		if alive(pid) {
			t.Errorf("child %d outlived Kill by 10 s", pid)
		}
	}
	if _, err := spannerCall("GET", rest, "/v1/projects/"+SpannerProject+"/instances", nil); err == nil {
		t.Fatal("the emulator still answers after Kill")
	}
}
