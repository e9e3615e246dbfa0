package testsvc

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The cross-process race: RaceProcesses re-runs the test binary twice with
// TESTSVC_RACE_CHILD set (to the start instant) and the caller's environment; in each child, the test's
// TestMain calls RaceChild with a backend built from that environment.
// Both children wait for one start instant, then claim one key from eight
// goroutines each.

const raceChildEnv = "TESTSVC_RACE_CHILD"

// IsRaceChild reports whether this process is a RaceProcesses child.
func IsRaceChild() bool { return os.Getenv(raceChildEnv) != "" }

// RaceChild claims the key "contended" from eight goroutines at the start
// instant the parent chose, printing each outcome on a line. It returns
// the exit code for TestMain.
func RaceChild(b store.Backend) int {
	var startNs int64
	fmt.Sscan(os.Getenv(raceChildEnv), &startNs)
	time.Sleep(time.Until(time.Unix(0, startNs)))
	var wg sync.WaitGroup
	var mu sync.Mutex
	for range 8 {
		wg.Go(func() {
			r, err := b.Claim(context.Background(), "contended", time.Minute)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				fmt.Println("error:", err)
				return
			}
			fmt.Println(r.Outcome)
		})
	}
	wg.Wait()
	return 0
}

// RaceProcesses runs two race children with env added to this process's
// environment and returns how many of their 16 claims won and how many
// found the key held.
func RaceProcesses(t *testing.T, env ...string) (won, held int) {
	t.Helper()
	start := fmt.Sprint(time.Now().Add(1500 * time.Millisecond).UnixNano())
	outs := make(chan string, 2)
	for range 2 {
		go func() {
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(append(os.Environ(), env...), raceChildEnv+"="+start)
			out, err := cmd.CombinedOutput()
			if err != nil {
				out = append(out, "race child failed: "+err.Error()...)
			}
			outs <- string(out)
		}()
	}
	all := <-outs + <-outs
	won, held = strings.Count(all, "won\n"), strings.Count(all, "held by other\n")
	if won+held != 16 {
		t.Fatalf("the race children reported %d outcomes, want 16:\n%s", won+held, all)
	}
	return won, held
}
