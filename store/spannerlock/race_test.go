package spannerlock_test

import (
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
)

// Two processes (this test binary, run twice) claim one key from eight
// goroutines each at the same instant, through Dial and the environment:
// exactly one of the 16 claims wins. The emulator aborts all but one of
// the concurrent transactions; the Spanner client and the backend run
// them again.
func TestTwoProcessesRaceOneKey(t *testing.T) {
	testsvc.Spanner(t)
	db := database(t)
	won, held := testsvc.RaceProcesses(t, "HELPER_DB="+db)
	if won != 1 || held != 15 {
		t.Fatalf("%d won and %d held, want 1 and 15", won, held)
	}
}
