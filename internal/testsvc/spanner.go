package testsvc

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The Spanner emulator's instance that [Spanner] creates, in the project
// and under the instance ID below. Tests create databases of their own in
// it ([SpannerDatabase]).
const (
	SpannerProject    = "idempotency-test"
	SpannerInstanceID = "test"
	SpannerInstance   = "projects/" + SpannerProject + "/instances/" + SpannerInstanceID
)

const spannerHow = "install the Google Cloud SDK's cloud-spanner-emulator (gcloud components install cloud-spanner-emulator), or set SPANNER_EMULATOR_HOST (and SPANNER_EMULATOR_REST_HOST when its REST port is not the gRPC port + 10)"

var (
	sharedSpanner shared
	spannerREST   string // the shared emulator's REST host:port, once known
)

// SpannerEmulator returns the path of the Spanner emulator's gateway: under
// the SDK root that gcloud reports, else under /usr/lib/google-cloud-sdk.
func SpannerEmulator() string {
	const rel = "bin/cloud_spanner_emulator/gateway_main"
	return inSDK(rel, spannerFileExists)
}

func spannerFileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// Spanner returns the gRPC host:port of a Spanner emulator shared by the
// whole test binary, and sets SPANNER_EMULATOR_HOST to it for clients in
// this process: the variable's own value when set, else an emulator it
// starts (gateway_main, which runs emulator_main as its child; both die
// at [StopAll]). Either way the instance [SpannerInstance] exists
// afterwards. The emulator runs one read-write transaction at a time per
// database and aborts the others, so tests that run in parallel should
// each use a database of their own ([SpannerDatabase]). Call it before
// any t.Parallel.
func Spanner(t testing.TB) string {
	t.Helper()
	if addr := os.Getenv("SPANNER_EMULATOR_HOST"); addr != "" && !sharedSpanner.started() {
		rest := os.Getenv("SPANNER_EMULATOR_REST_HOST")
		if rest == "" {
			host, port, err := net.SplitHostPort(addr)
			n, err2 := strconv.Atoi(port)
			if err != nil || err2 != nil {
				t.Fatalf("SPANNER_EMULATOR_HOST=%q is not host:port", addr)
			}
			rest = net.JoinHostPort(host, strconv.Itoa(n+10))
		}
		spannerREST = rest
		if err := spannerInstance(rest); err != nil {
			t.Fatal(err)
		}
		return addr
	}
	bin := SpannerEmulator()
	if !spannerFileExists(bin) {
		Missing(t, "the Spanner emulator", spannerHow)
	}
	return sharedSpanner.get(t, "testsvc-spanner-", func(dir string) (*Process, string, error) {
		p, addr, rest, err := startSpanner(bin, dir)
		if err != nil {
			return nil, "", err
		}
		if err := spannerInstance(rest); err != nil {
			p.Kill()
			return nil, "", err
		}
		spannerREST = rest
		os.Setenv("SPANNER_EMULATOR_HOST", addr)
		return p, addr, nil
	})
}

// StartSpanner starts a Spanner emulator of the test's own (to kill or
// restart), with the instance [SpannerInstance], stopped when the test
// ends. It leaves SPANNER_EMULATOR_HOST as it was, and returns the
// process (Addr is the gRPC address) and the REST address.
func StartSpanner(t testing.TB) (p *Process, rest string) {
	t.Helper()
	bin := SpannerEmulator()
	if !spannerFileExists(bin) {
		Missing(t, "the Spanner emulator", spannerHow)
	}
	p, _, rest, err := startSpanner(bin, t.TempDir())
	if err == nil {
		if err = spannerInstance(rest); err != nil {
			p.Kill()
		}
	}
	return own(t, p, err), rest
}

// startSpanner starts gateway_main on two free loopback ports (gRPC and
// REST) and waits until its REST side answers.
func startSpanner(bin, dir string) (p *Process, addr, rest string, err error) {
	grpcPort, addr, err := freeAddr()
	if err != nil {
		return nil, "", "", err
	}
	restPort, rest, err := freeAddr()
	if err != nil {
		return nil, "", "", err
	}
	args := []string{
		"--hostname", "127.0.0.1",
		"--grpc_port", strconv.Itoa(grpcPort),
		"--http_port", strconv.Itoa(restPort),
		"--copy_emulator_stdout",
	}
	p, err = Start("spanner-emulator", bin, dir, addr, args, func(string) error {
		_, err := spannerCall("GET", rest, "/v1/projects/"+SpannerProject+"/instances", nil)
		return err
	})
	return p, addr, rest, err
}

// spannerInstance creates SpannerInstance through the emulator's REST
// gateway at rest, unless it exists.
func spannerInstance(rest string) error {
	_, err := spannerCall("POST", rest, "/v1/projects/"+SpannerProject+"/instances", map[string]any{
		"instanceId": SpannerInstanceID,
		"instance":   map[string]any{"config": "emulator-config", "displayName": SpannerInstanceID, "nodeCount": 1},
	})
	if err != nil && !strings.Contains(err.Error(), "already exists") {
		return fmt.Errorf("creating the Spanner emulator's instance: %w", err)
	}
	return nil
}

// SpannerDatabase creates a database of the test's own, with a random
// name, in [SpannerInstance] of the shared emulator (starting it through
// [Spanner] if need be), runs ddl in it, and drops it when the test ends.
// It returns the database's full name,
// projects/P/instances/I/databases/D.
func SpannerDatabase(t testing.TB, ddl ...string) string {
	t.Helper()
	Spanner(t)
	id := fmt.Sprintf("t%016x", rand.Uint64())
	if _, err := spannerCall("POST", spannerREST, "/v1/"+SpannerInstance+"/databases", map[string]any{
		"createStatement": "CREATE DATABASE `" + id + "`",
		"extraStatements": ddl,
	}); err != nil {
		t.Fatalf("creating Spanner database %s: %v", id, err)
	}
	name := SpannerInstance + "/databases/" + id
	t.Cleanup(func() { spannerCall("DELETE", spannerREST, "/v1/"+name, nil) })
	return name
}

// spannerCall sends one REST request to the emulator's gateway and returns
// the body of a 200 reply, or an error with the reply's message. The
// emulator finishes its admin operations before it answers.
func spannerCall(method, rest, path string, body any) ([]byte, error) {
	var in io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		in = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, "http://"+rest+path, in)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	c := http.Client{Timeout: 30 * time.Second}
	res, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer res.Body.Close()
	out, err := io.ReadAll(res.Body)
	if err != nil {
		return nil, err
	}
	if res.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s %s: %s: %s", method, path, res.Status, bytes.TrimSpace(out))
	}
	if bytes.Contains(out, []byte(`"error"`)) {
		return nil, fmt.Errorf("%s %s: %s", method, path, bytes.TrimSpace(out))
	}
	return out, nil
}
