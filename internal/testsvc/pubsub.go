package testsvc

import (
	"fmt"
	"os"
	"testing"
)

// PubSubEmulator is where the gcloud SDK keeps the Pub/Sub emulator.
const PubSubEmulator = "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator"

const pubsubHow = "install the Google Cloud SDK's pubsub-emulator (and a Java runtime), or set PUBSUB_EMULATOR_HOST"

var sharedPubSub shared

// PubSub returns the host:port of a Pub/Sub emulator shared by the whole
// test binary: PUBSUB_EMULATOR_HOST when set, else one it starts. Tests
// sharing it must use projects or topics of their own. Unlike [Datastore],
// it leaves PUBSUB_EMULATOR_HOST as it was.
func PubSub(t testing.TB) string {
	t.Helper()
	if addr := os.Getenv("PUBSUB_EMULATOR_HOST"); addr != "" && !sharedPubSub.started() {
		return addr
	}
	if _, err := os.Stat(PubSubEmulator); err != nil {
		Missing(t, "the Pub/Sub emulator", pubsubHow)
	}
	return sharedPubSub.get(t, "testsvc-pubsub-", func(dir string) (*Process, string, error) {
		return startEmulator("pubsub-emulator", PubSubEmulator, dir, func(port int) []string {
			return []string{"--host=127.0.0.1", fmt.Sprintf("--port=%d", port)}
		})
	})
}
