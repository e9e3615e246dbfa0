package testsvc

import "testing"

// Both children run and report their eight claims each. Each child here
// has a fake of its own (the backends' tests share a server), so each wins
// its key exactly once.
func TestRaceProcessesReportsEveryClaim(t *testing.T) {
	t.Parallel()
	won, held := RaceProcesses(t)
	if won != 2 || held != 14 {
		t.Fatalf("won %d, held %d; want 2 and 14 (one win per child's own store)", won, held)
	}
}
