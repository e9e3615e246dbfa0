package testsvc

import (
	"fmt"
	"os"
	"os/exec"
	"testing"
)

// DatastoreEmulator is where the gcloud SDK keeps the legacy Datastore
// emulator (the Firestore emulator's Datastore mode rejects some of what
// the backend does).
const DatastoreEmulator = "/usr/lib/google-cloud-sdk/platform/cloud-datastore-emulator/cloud_datastore_emulator"

const datastoreHow = "install the Google Cloud SDK's cloud-datastore-emulator (and a Java runtime), or set DATASTORE_EMULATOR_HOST"

var sharedDatastore shared

// Datastore returns the host:port of a Datastore emulator shared by the
// whole test binary, and sets DATASTORE_EMULATOR_HOST to it for clients in
// this process: the variable's own value when set, else an emulator it
// starts (in memory, consistency 1.0). Tests sharing it must use a
// namespace or kind of their own. Call it before any t.Parallel.
func Datastore(t testing.TB) string {
	t.Helper()
	if addr := os.Getenv("DATASTORE_EMULATOR_HOST"); addr != "" && !sharedDatastore.started() {
		return addr
	}
	if _, err := os.Stat(DatastoreEmulator); err != nil {
		Missing(t, "the Datastore emulator", datastoreHow)
	}
	if _, err := exec.LookPath("java"); err != nil {
		Missing(t, "java (for the Datastore emulator)", datastoreHow)
	}
	return sharedDatastore.get(t, "testsvc-datastore-", func(dir string) (*Process, string, error) {
		p, addr, err := startEmulator("datastore-emulator", DatastoreEmulator, dir, func(port int) []string {
			return []string{
				"start", "--host=127.0.0.1", fmt.Sprintf("--port=%d", port),
				"--testing", "--store_on_disk=false", "--consistency=1.0",
			}
		})
		if err == nil {
			os.Setenv("DATASTORE_EMULATOR_HOST", addr)
		}
		return p, addr, err
	})
}
