package function_test

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	_ "github.com/gcp-pubsub-idempotency/idempotency/function_example"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/ffserve"
)

// The function is served exactly as the buildpack serves it: its package
// registered by init, FUNCTION_TARGET naming it, funcframework at "/".
func TestHandleOrderSendsEachOrderOnce(t *testing.T) {
	var mu sync.Mutex
	got := map[string][]string{}
	supplier := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		k := r.Header.Get("Idempotency-Key")
		got[k] = append(got[k], r.Header.Get("X-Fence"))
	}))
	defer supplier.Close()
	t.Setenv("SUPPLIER_URL", supplier.URL)
	t.Setenv("FUNCTION_TARGET", "HandleOrder")

	url, _, err := ffserve.Start("")
	if err != nil {
		t.Fatal(err)
	}

	for _, name := range []string{"eventarc_binary", "eventarc_binary", "push_raw", "republish", "eventarc_structured"} {
		if code := post(t, url, name); code != http.StatusOK {
			t.Fatalf("%s: HTTP %d", name, code)
		}
	}
	if code := post(t, url, "unkeyed"); code/100 == 2 {
		t.Fatalf("unkeyed: HTTP %d, want a nack", code)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 1 || len(got["orders:PO-1001"]) != 1 || got["orders:PO-1001"][0] != "1" {
		t.Fatalf("supplier received %v; want order PO-1001 once, fence 1", got)
	}
}

func post(t *testing.T, url, fixture string) int {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "testdata", fixture+".http"))
	if err != nil {
		t.Fatal(err)
	}
	head, body, _ := bytes.Cut(raw, []byte("\n\n"))
	lines := strings.Split(string(head), "\n")
	path := strings.Fields(lines[0])[1]
	req, _ := http.NewRequest(http.MethodPost, url+path, bytes.NewReader(bytes.TrimRight(body, "\n")))
	for _, h := range lines[1:] {
		k, v, _ := strings.Cut(h, ":")
		req.Header.Set(k, strings.TrimSpace(v))
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// The function's instance, started as the buildpack's main starts it (the
// package's init, here the test binary's, running no test), on Cloud Run
// (K_SERVICE set): without a store to share it fails to start, saying what
// to set, rather than serve on an in-memory store of its own.
func TestFunctionOnCloudRunRefusesToStartWithoutASharedStore(t *testing.T) {
	down := httptest.NewServer(http.NotFoundHandler())
	metadataHost := strings.TrimPrefix(down.URL, "http://")
	down.Close() // nothing answers there: no metadata server
	base := []string{"K_SERVICE=orders", "GCE_METADATA_HOST=" + metadataHost, "IDEMPOTENCY_BACKEND=", "REDIS_ADDR=",
		"POSTGRES_DSN=", "GOOGLE_CLOUD_PROJECT=", "DATASTORE_PROJECT_ID=", "IDEMPOTENCY_ALLOW_MEMORY_ON_CLOUD_RUN="}
	for _, c := range []struct {
		env   []string
		start bool
		say   string
	}{
		{nil, false, "set GOOGLE_CLOUD_PROJECT"},
		{[]string{"IDEMPOTENCY_BACKEND=memory"}, false, "IDEMPOTENCY_ALLOW_MEMORY_ON_CLOUD_RUN=true"},
		{[]string{"IDEMPOTENCY_BACKEND=memory", "IDEMPOTENCY_ALLOW_MEMORY_ON_CLOUD_RUN=true"}, true, "IDEMPOTENCY_BACKEND=memory on Cloud Run"},
	} {
		cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^$")
		cmd.Env = append(append(os.Environ(), base...), c.env...)
		out, err := cmd.CombinedOutput()
		if started := err == nil; started != c.start || !strings.Contains(string(out), c.say) {
			t.Errorf("%q: started %v (%v), want %v, saying %q; output:\n%s", c.env, started, err, c.start, c.say, out)
		}
	}
}
