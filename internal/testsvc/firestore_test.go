package testsvc

import (
	"os"
	"testing"
)

// The emulator answers, and clients in this process find it through
// FIRESTORE_EMULATOR_HOST.
func TestFirestoreAnswersAndIsNamedInTheEnvironment(t *testing.T) {
	addr := Firestore(t)
	if err := HTTPReady(addr); err != nil {
		t.Fatal(err)
	}
	if got := os.Getenv("FIRESTORE_EMULATOR_HOST"); got != addr {
		t.Fatalf("FIRESTORE_EMULATOR_HOST = %q, want %q", got, addr)
	}
	if again := Firestore(t); again != addr {
		t.Fatalf("Firestore returned %q, then %q", addr, again)
	}
}

// A Firestore emulator of the test's own keeps its address across a
// restart.
func TestStartFirestoreRestartsOnItsAddress(t *testing.T) {
	p := StartFirestore(t)
	if err := HTTPReady(p.Addr); err != nil {
		t.Fatal(err)
	}
	if err := p.Restart(HTTPReady); err != nil {
		t.Fatal(err)
	}
	if err := HTTPReady(p.Addr); err != nil {
		t.Fatalf("after restart: %v", err)
	}
}
