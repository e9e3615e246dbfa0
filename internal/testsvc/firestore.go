package testsvc

import (
	"fmt"
	"os"
	"os/exec"
	"testing"
)

const firestoreHow = "install the Google Cloud SDK's cloud-firestore-emulator (gcloud components install cloud-firestore-emulator) and a Java runtime, or set FIRESTORE_EMULATOR_HOST"

var sharedFirestore shared

// FirestoreEmulator returns the path of the Firestore emulator: under the
// SDK root that gcloud reports, else under /usr/lib/google-cloud-sdk.
func FirestoreEmulator() string {
	const rel = "platform/cloud-firestore-emulator/cloud_firestore_emulator"
	return inSDK(rel, firestoreFileExists)
}

// Firestore returns the host:port of a Firestore (Native mode) emulator
// shared by the whole test binary, and sets FIRESTORE_EMULATOR_HOST to it
// for clients in this process: the variable's own value when set, else an
// emulator it starts. Tests sharing it must use a collection of their own.
// Call it before any t.Parallel.
func Firestore(t testing.TB) string {
	t.Helper()
	if addr := os.Getenv("FIRESTORE_EMULATOR_HOST"); addr != "" && !sharedFirestore.started() {
		return addr
	}
	bin := firestoreBinary(t)
	return sharedFirestore.get(t, "testsvc-firestore-", func(dir string) (*Process, string, error) {
		p, addr, err := startFirestore(bin, dir)
		if err == nil {
			os.Setenv("FIRESTORE_EMULATOR_HOST", addr)
		}
		return p, addr, err
	})
}

// StartFirestore starts a Firestore emulator of the test's own (to kill or
// restart), stopped when the test ends. It leaves FIRESTORE_EMULATOR_HOST
// as it was.
func StartFirestore(t testing.TB) *Process {
	t.Helper()
	bin := firestoreBinary(t)
	p, _, err := startFirestore(bin, t.TempDir())
	return own(t, p, err)
}

// firestoreBinary finds the emulator and java, or skips (fails under
// Required) saying how to get them.
func firestoreBinary(t testing.TB) string {
	t.Helper()
	bin := FirestoreEmulator()
	if !firestoreFileExists(bin) {
		Missing(t, "the Firestore emulator", firestoreHow)
	}
	if _, err := exec.LookPath("java"); err != nil {
		Missing(t, "java (for the Firestore emulator)", firestoreHow)
	}
	return bin
}

// firestoreFileExists reports whether p exists.
func firestoreFileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func startFirestore(bin, dir string) (*Process, string, error) {
	return startEmulator("firestore-emulator", bin, dir, func(port int) []string {
		return []string{"start", "--host=127.0.0.1", fmt.Sprintf("--port=%d", port)}
	})
}
