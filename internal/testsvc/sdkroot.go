package testsvc

import (
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
)

// defaultSDKRoot is where Debian's google-cloud-cli package puts the SDK.
const defaultSDKRoot = "/usr/lib/google-cloud-sdk"

// sdkRoot is the Google Cloud SDK's root as gcloud reports it, else
// defaultSDKRoot. gcloud is asked once per process: it is a Python program
// that takes seconds to answer on a loaded machine, and the emulator
// lookups run once per test harness (hundreds per package).
var sdkRoot = sync.OnceValue(func() string {
	if out, err := exec.Command("gcloud", "info", "--format=value(installation.sdk_root)").Output(); err == nil {
		if root := strings.TrimSpace(string(out)); root != "" {
			return root
		}
	}
	return defaultSDKRoot
})

// inSDK returns the path of rel under the SDK root gcloud reports when it
// exists there (exists tells), else under defaultSDKRoot.
func inSDK(rel string, exists func(string) bool) string {
	if p := filepath.Join(sdkRoot(), rel); exists(p) {
		return p
	}
	return filepath.Join(defaultSDKRoot, rel)
}
