package testsvc

import (
	"os"
	"testing"
)

// The emulator answers, and clients in this process find it through
// DATASTORE_EMULATOR_HOST.
func TestDatastoreAnswersAndIsNamedInTheEnvironment(t *testing.T) {
	addr := Datastore(t)
	if err := HTTPReady(addr); err != nil {
		t.Fatal(err)
	}
	if got := os.Getenv("DATASTORE_EMULATOR_HOST"); got != addr {
		t.Fatalf("DATASTORE_EMULATOR_HOST = %q, want %q", got, addr)
	}
	if again := Datastore(t); again != addr {
		t.Fatalf("Datastore returned %q, then %q", addr, again)
	}
}
