package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The directory scripts/function-source.sh writes is what gcloud uploads:
// it must build with nothing but itself, with no module proxy and no
// access to this repository (its replace directive points at a path Cloud
// Build does not have).
func TestFunctionSourceBuildsFromItsVendorDirectoryAlone(t *testing.T) {
	for _, f := range []string{"go.mod", "go.sum", "function.go", "vendor/modules.txt",
		"vendor/github.com/gcp-pubsub-idempotency/idempotency/idempotent.go",
		"vendor/github.com/GoogleCloudPlatform/functions-framework-go/funcframework/framework.go"} {
		if _, err := os.Stat(filepath.Join(functionDir, f)); err != nil {
			t.Fatalf("the function source lacks %s", f)
		}
	}
	// A copy elsewhere, so the replace path is not next to it either.
	dst := filepath.Join(t.TempDir(), "upload")
	if out, err := exec.Command("cp", "-r", functionDir, dst).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v %s", err, out)
	}
	// Beside it, the buildpack-style main (it imports funcframework, which
	// must therefore be vendored as well).
	if err := os.MkdirAll(filepath.Join(dst, "serverless_function_app"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dst, "serverless_function_app", "main.go"), []byte(generatedMain), 0o644); err != nil {
		t.Fatal(err)
	}
	// The build cache stays: it holds compiled objects keyed by the
	// content of their sources, never sources, so every package must still
	// be found in vendor/. With -trimpath (as TestMain builds too), the
	// vendored copies of packages already compiled from the module cache
	// hit the cache instead of compiling again (minutes on a loaded machine).
	gocache, err := exec.Command("go", "env", "GOCACHE").Output()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", "build", "-trimpath", "./...")
	cmd.Dir = dst
	cmd.Env = append(os.Environ(), "GOPROXY=off", "GOFLAGS=-mod=vendor", "GOCACHE="+strings.TrimSpace(string(gocache)),
		"HOME="+t.TempDir(), "GOPATH="+t.TempDir(), "GOMODCACHE="+t.TempDir())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build in the upload copy, offline, with an empty module cache: %v\n%s", err, out)
	}
	mod, _ := os.ReadFile(filepath.Join(dst, "go.mod"))
	if !strings.Contains(string(mod), "module example.com/orders-function") {
		t.Fatalf("go.mod:\n%s", mod)
	}
}
