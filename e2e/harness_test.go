// Package e2e runs the example function as deployed, against the Pub/Sub
// and Datastore emulators: real push subscriptions into a fleet of function
// processes behind a round-robin balancer, with an idempotent supplier that
// records every side effect.
package e2e

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
)

// serverBin is the function server, built once in TestMain from the
// deployable source directory functionDir; serviceBin is the plain net/http
// Cloud Run service example. buildDir holds them (and anything else a test
// builds) until the binary ends.
var serverBin, functionDir, serviceBin, buildDir string

func TestMain(m *testing.M) {
	code := func() int {
		dir, err := os.MkdirTemp("", "e2e-build-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		defer os.RemoveAll(dir)
		buildDir = dir
		if serverBin, err = buildServer(dir); err != nil {
			fmt.Fprintln(os.Stderr, "building the function server:", err)
			return 2
		}
		serviceBin = filepath.Join(dir, "cloudrun")
		if out, err := exec.Command("go", "build", "-o", serviceBin, "../function_example/cmd/cloudrun").CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "building the Cloud Run service example: %v\n%s", err, out)
			return 2
		}
		return m.Run()
	}()
	testsvc.StopAll()
	os.Exit(code)
}

// generatedMain is what the Cloud Run functions buildpack generates for a
// Go function: a main that imports the function package (whose init
// registers the functions) and starts the functions framework on $PORT,
// serving $FUNCTION_TARGET. The harness adds two things to its outgoing
// requests: with E2E_CRASH_RATE > 0, the process exits at that rate right
// after the supplier accepted an order, before the claim is completed (the
// crash window no lock can close); and every request carries
// E2E_INCARNATION, the harness's number for this process, and the lease
// expiry of the claim it is sent under, so the supplier can tell which
// process sent what, and whether a holder's lease was still live.
const generatedMain = `package main

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"strings"

	"github.com/GoogleCloudPlatform/functions-framework-go/funcframework"
	"github.com/gcp-pubsub-idempotency/idempotency"

	_ "example.com/orders-function"
)

type crashAfterSend struct {
	next        http.RoundTripper
	rate        float64
	incarnation string
}

func (c crashAfterSend) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("X-E2E-Incarnation", c.incarnation)
	if claim, ok := idempotency.ClaimFrom(r.Context()); ok {
		r.Header.Set("X-E2E-Lease-Expiry", strconv.FormatInt(claim.LeaseExpiry.UnixMilli(), 10))
	}
	resp, err := c.next.RoundTrip(r)
	if err == nil && resp.StatusCode/100 == 2 && r.Method == http.MethodPost &&
		strings.HasSuffix(r.URL.Path, "/orders") && rand.Float64() < c.rate {
		fmt.Fprintln(os.Stderr, "e2e: crashing after the send, before complete")
		os.Exit(3)
	}
	return resp, err
}

func main() {
	rate, _ := strconv.ParseFloat(os.Getenv("E2E_CRASH_RATE"), 64)
	http.DefaultTransport = crashAfterSend{http.DefaultTransport, rate, os.Getenv("E2E_INCARNATION")}
	if err := funcframework.Start(os.Getenv("PORT")); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
`

// buildServer writes the deployable source directory with
// scripts/function-source.sh, then builds a buildpack-style main against
// it.
func buildServer(dir string) (string, error) {
	repo, err := filepath.Abs("..")
	if err != nil {
		return "", err
	}
	fn, app := filepath.Join(dir, "function"), filepath.Join(dir, "app")
	functionDir = fn
	if out, err := exec.Command(filepath.Join(repo, "scripts", "function-source.sh"), fn).CombinedOutput(); err != nil {
		return "", fmt.Errorf("function-source.sh: %v\n%s", err, out)
	}
	if err := os.MkdirAll(app, 0o755); err != nil {
		return "", err
	}
	gomod := fmt.Sprintf(`module functions.local/app

go 1.26

require example.com/orders-function v0.0.0-00010101000000-000000000000

replace example.com/orders-function => %s
%s`, fn, localReplaces(repo))
	if err := os.WriteFile(filepath.Join(app, "go.mod"), []byte(gomod), 0o644); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(app, "main.go"), []byte(generatedMain), 0o644); err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "server")
	// -trimpath, so that TestFunctionSourceBuildsFromItsVendorDirectoryAlone
	// finds the packages compiled here in the build cache.
	for _, args := range [][]string{{"mod", "tidy"}, {"build", "-trimpath", "-o", bin, "."}} {
		cmd := exec.Command("go", args...)
		cmd.Dir = app
		cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOWORK=off")
		if out, err := cmd.CombinedOutput(); err != nil {
			return "", fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	return bin, nil
}

// localReplaces is the replace directives that build a scratch module
// against this checkout: the root module, each backend module and the
// example's module (none is published).
func localReplaces(repo string) string {
	const m = "github.com/gcp-pubsub-idempotency/idempotency"
	var b strings.Builder
	b.WriteString("\nreplace (\n")
	fmt.Fprintf(&b, "\t%s => %s\n", m, repo)
	for _, sub := range []string{"store/datastorelock", "store/redislock", "store/sqllock", "function_example"} {
		fmt.Fprintf(&b, "\t%s/%s => %s\n", m, sub, filepath.Join(repo, sub))
	}
	b.WriteString(")\n")
	return b.String()
}

// pubsub talks to the emulator's REST API for one project.
type pubsub struct {
	base, project string
}

func newPubSub(t *testing.T, name string) *pubsub {
	return &pubsub{base: "http://" + testsvc.PubSub(t), project: fmt.Sprintf("e2e-%s-%06d", name, rand.IntN(1e6))}
}

func (p *pubsub) do(t *testing.T, method, path string, body, out any) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, p.base+"/v1/projects/"+p.project+path, rd)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		t.Fatalf("pubsub %s %s: %s %s", method, path, resp.Status, b)
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			t.Fatal(err)
		}
	}
}

func (p *pubsub) topic(t *testing.T, name string) {
	p.do(t, http.MethodPut, "/topics/"+name, nil, nil)
}

// subscribe creates a push subscription on topic delivering to endpoint
// (the topic's path is appended, as the functions framework wants it for a
// raw push), or with endpoint "" a pull subscription. Either has the
// emulator's shortest ack deadline, 10 s. It is deleted when t ends.
func (p *pubsub) subscribe(t *testing.T, name, topic, endpoint string) {
	sub := map[string]any{
		"topic":              "projects/" + p.project + "/topics/" + topic,
		"ackDeadlineSeconds": 10,
	}
	if endpoint != "" {
		sub["pushConfig"] = map[string]any{"pushEndpoint": endpoint + "/projects/" + p.project + "/topics/" + topic}
	}
	p.do(t, http.MethodPut, "/subscriptions/"+name, sub, nil)
	t.Cleanup(func() {
		req, _ := http.NewRequest(http.MethodDelete, p.base+"/v1/projects/"+p.project+"/subscriptions/"+name, nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	})
}

// publish publishes one message and returns its messageId.
func (p *pubsub) publish(t *testing.T, topic string, attrs map[string]string, data any) string {
	b, _ := json.Marshal(data)
	var out struct {
		MessageIDs []string `json:"messageIds"`
	}
	p.do(t, http.MethodPost, "/topics/"+topic+":publish", map[string]any{
		"messages": []any{map[string]any{"data": base64.StdEncoding.EncodeToString(b), "attributes": attrs}},
	}, &out)
	return out.MessageIDs[0]
}

// supplier is the sink: an idempotent order endpoint keyed by
// Idempotency-Key, and a status store that notices interleaved
// read-modify-writes.
type supplier struct {
	srv *httptest.Server

	mu        sync.Mutex
	calls     map[string]int // raw POST /orders per key, re-sends included
	log       []supplierCall // every POST /orders, in arrival order
	failFirst map[string]int // answer 500 to this many first calls of a key
	history   map[string][]string
	reading   map[string]int
	overlaps  int
}

func newSupplier(t *testing.T) *supplier {
	s := &supplier{calls: map[string]int{}, failFirst: map[string]int{}, history: map[string][]string{}, reading: map[string]int{}}
	s.srv = httptest.NewServer(http.HandlerFunc(s.serve))
	t.Cleanup(s.srv.Close)
	return s
}

func (s *supplier) serve(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/orders":
		k := r.Header.Get("Idempotency-Key")
		s.calls[k]++
		fence, _ := strconv.ParseInt(r.Header.Get("X-Fence"), 10, 64)
		inc, _ := strconv.ParseInt(r.Header.Get("X-E2E-Incarnation"), 10, 64)
		lease, _ := strconv.ParseInt(r.Header.Get("X-E2E-Lease-Expiry"), 10, 64)
		s.log = append(s.log, supplierCall{key: k, fence: fence, incarnation: inc, leaseExpiry: time.UnixMilli(lease), at: time.Now()})
		if s.failFirst[k] > 0 {
			s.failFirst[k]--
			http.Error(w, "supplier hiccup", http.StatusInternalServerError)
		}
	case strings.HasPrefix(r.URL.Path, "/status/"):
		po := strings.TrimPrefix(r.URL.Path, "/status/")
		if r.Method == http.MethodGet {
			s.reading[po]++
			if s.reading[po] > 1 {
				s.overlaps++
			}
			json.NewEncoder(w).Encode(s.history[po])
			return
		}
		var h []string
		json.NewDecoder(r.Body).Decode(&h)
		s.history[po] = h
		s.reading[po]--
	default:
		http.NotFound(w, r)
	}
}

// supplierCall is one POST /orders as the supplier received it.
type supplierCall struct {
	key         string    // Idempotency-Key: the key the sender held
	fence       int64     // X-Fence: the sender's fence on that key
	incarnation int64     // X-E2E-Incarnation: the process that sent it
	leaseExpiry time.Time // X-E2E-Lease-Expiry: when the sender's lease lapses
	at          time.Time // when it arrived
}

// callLog returns a copy of every POST /orders so far, in arrival order.
func (s *supplier) callLog() []supplierCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]supplierCall(nil), s.log...)
}

// orders returns how many distinct orders the supplier holds, and how many
// calls it received in all.
func (s *supplier) orders() (distinct, calls int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, n := range s.calls {
		calls += n
	}
	return len(s.calls), calls
}

func (s *supplier) callsFor(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[key]
}

// instance is one function process, restarted when it dies, as Cloud Run
// replaces a crashed instance.
type instance struct {
	port    int
	mu      sync.Mutex
	cmd     *exec.Cmd
	started time.Time // when cmd started
	n       int64     // cmd's process number (E2E_INCARNATION)
}

// fleet runs n instances of one program: function instances behind a
// round-robin balancer (startFleetOf), or pull subscribers
// (startProcesses).
type fleet struct {
	t         *testing.T
	instances []*instance
	lb        *httptest.Server
	stop      atomic.Bool
	wg        sync.WaitGroup

	bin        string
	deliveries atomic.Int64
	mu         sync.Mutex
	statuses   map[int]int
	crashes    atomic.Int64 // injected os.Exit after a send
	kills      atomic.Int64 // SIGKILL from outside

	incarnations atomic.Int64             // processes started so far; each gets the next number
	deaths       map[int64]time.Time      // when each dead process was seen to exit
	logs         map[int64]*syncBuffer    // each process's stdout and stderr
	acks         map[string]time.Time     // the first 2xx answer to a delivery of each order key
	keyOf        func(body []byte) string // the order key a push request carries ("" if none)
}

func startFleet(t *testing.T, n int, env ...string) *fleet {
	return startFleetOf(t, serverBin, n, env...)
}

// startFleetOf runs n instances of bin behind a round-robin balancer.
func startFleetOf(t *testing.T, bin string, n int, env ...string) *fleet {
	f := startProcesses(t, bin, n, env...)
	var next atomic.Int64
	proxy := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			in := f.instances[int(next.Add(1))%len(f.instances)]
			r.SetURL(&url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", in.port)})
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			w.WriteHeader(http.StatusBadGateway) // the instance is down: Pub/Sub retries
		},
		ModifyResponse: func(resp *http.Response) error {
			f.count(resp.StatusCode)
			if k, _ := resp.Request.Context().Value(orderKeyCtx{}).(string); k != "" && resp.StatusCode/100 == 2 {
				f.ack(k)
			}
			return nil
		},
	}
	f.lb = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.deliveries.Add(1)
		if body, err := io.ReadAll(r.Body); err == nil {
			r.Body = io.NopCloser(bytes.NewReader(body))
			r = r.WithContext(context.WithValue(r.Context(), orderKeyCtx{}, f.keyOf(body)))
		}
		rec := &statusRecorder{ResponseWriter: w}
		proxy.ServeHTTP(rec, r)
		if rec.code == http.StatusBadGateway {
			f.count(http.StatusBadGateway)
		}
	}))
	return f
}

// startProcesses runs n instances of bin, each restarted when it dies, and
// waits until every one answers on its $PORT. The fleet has no balancer:
// startFleetOf adds it for push; pull subscribers fetch their own work.
func startProcesses(t *testing.T, bin string, n int, env ...string) *fleet {
	f := &fleet{t: t, statuses: map[int]int{}, bin: bin, deaths: map[int64]time.Time{}, logs: map[int64]*syncBuffer{}, acks: map[string]time.Time{}, keyOf: orderKey}
	for range n {
		port, err := testsvc.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		in := &instance{port: port}
		f.instances = append(f.instances, in)
		f.wg.Go(func() { f.supervise(in, env) })
	}
	t.Cleanup(f.close)
	deadline := time.Now().Add(30 * time.Second)
	for _, in := range f.instances {
		for !isServing(in.port) {
			if time.Now().After(deadline) {
				t.Fatalf("instance on port %d did not start", in.port)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return f
}

// isServing reports whether something accepts connections on port.
func isServing(port int) bool {
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/", port))
	if err != nil {
		return false
	}
	resp.Body.Close()
	return true
}

type statusRecorder struct {
	http.ResponseWriter
	code int
}

func (s *statusRecorder) WriteHeader(code int) {
	s.code = code
	s.ResponseWriter.WriteHeader(code)
}

// orderKeyCtx carries a delivery's order key from the balancer's handler
// to its ModifyResponse.
type orderKeyCtx struct{}

// orderKey returns the key HandleOrder holds for a raw push request:
// "orders:" and the message's po_id attribute.
func orderKey(body []byte) string {
	var env struct {
		Message struct {
			Attributes map[string]string `json:"attributes"`
		} `json:"message"`
	}
	if json.Unmarshal(body, &env) != nil || env.Message.Attributes["po_id"] == "" {
		return ""
	}
	return "orders:" + env.Message.Attributes["po_id"]
}

// ack records that a delivery of key was answered with a 2xx: the function
// says the key's work is done.
func (f *fleet) ack(key string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.acks[key]; !ok {
		f.acks[key] = time.Now()
	}
}

// firstAck returns when a delivery of key was first acked, if it was.
func (f *fleet) firstAck(key string) (time.Time, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	at, ok := f.acks[key]
	return at, ok
}

// diedAt returns when process number n was seen to exit, if it did.
func (f *fleet) diedAt(n int64) (time.Time, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	at, ok := f.deaths[n]
	return at, ok
}

func (f *fleet) count(code int) {
	f.mu.Lock()
	f.statuses[code]++
	f.mu.Unlock()
}

func (f *fleet) statusCounts() map[int]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	m := map[int]int{}
	for k, v := range f.statuses {
		m[k] = v
	}
	return m
}

func (f *fleet) supervise(in *instance, env []string) {
	for !f.stop.Load() {
		n := f.incarnations.Add(1)
		cmd := exec.Command(f.bin)
		cmd.Env = append(os.Environ(), append([]string{fmt.Sprint("PORT=", in.port), fmt.Sprint("E2E_INCARNATION=", n)}, env...)...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		logs := &syncBuffer{}
		cmd.Stdout, cmd.Stderr = logs, logs
		f.mu.Lock()
		f.logs[n] = logs
		f.mu.Unlock()
		if err := cmd.Start(); err != nil {
			f.t.Errorf("starting an instance: %v", err)
			return
		}
		in.mu.Lock()
		in.cmd, in.started, in.n = cmd, time.Now(), n
		in.mu.Unlock()
		err := cmd.Wait()
		f.mu.Lock()
		f.deaths[n] = time.Now()
		f.mu.Unlock()
		if f.stop.Load() {
			return
		}
		if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 3 {
			f.crashes.Add(1)
		} else if !ok || ee.ProcessState.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			f.t.Errorf("an instance exited unexpectedly (%v):\n%s", err, logs.String())
		}
		time.Sleep(200 * time.Millisecond) // the platform starts a replacement
	}
}

// kill SIGKILLs instance i, as a platform or an OOM would, unless its
// process started less than minAge ago (so that on a slow machine the
// fleet is not kept down by kills faster than its start-ups). It reports
// whether it killed.
func (f *fleet) kill(i int, minAge time.Duration) bool {
	in := f.instances[i]
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.cmd != nil && in.cmd.Process != nil && time.Since(in.started) >= minAge && in.cmd.Process.Signal(syscall.SIGKILL) == nil {
		f.kills.Add(1)
		return true
	}
	return false
}

// killAny SIGKILLs one instance, chosen at random among those whose
// process is at least minAge old.
func (f *fleet) killAny(minAge time.Duration) {
	for _, i := range rand.Perm(len(f.instances)) {
		if f.kill(i, minAge) {
			return
		}
	}
}

// logOf returns what process number n has written so far.
func (f *fleet) logOf(n int64) string {
	f.mu.Lock()
	b := f.logs[n]
	f.mu.Unlock()
	if b == nil {
		return ""
	}
	return b.String()
}

// syncBuffer is a bytes.Buffer that a process writes while others read.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func (f *fleet) close() {
	f.stop.Store(true)
	for _, in := range f.instances {
		in.mu.Lock()
		if in.cmd != nil && in.cmd.Process != nil {
			in.cmd.Process.Kill()
		}
		in.mu.Unlock()
	}
	f.wg.Wait()
	if f.lb != nil {
		f.lb.Close()
	}
}

// eventually polls cond until it holds or the timeout passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// drained waits until the fleet has received no delivery for quiet.
func (f *fleet) drained(t *testing.T, quiet, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	last, since := f.deliveries.Load(), time.Now()
	for time.Since(since) < quiet {
		if time.Now().After(deadline) {
			t.Fatalf("deliveries still arriving after %v (%d so far; statuses %v)", timeout, f.deliveries.Load(), f.statusCounts())
		}
		time.Sleep(100 * time.Millisecond)
		if n := f.deliveries.Load(); n != last {
			last, since = n, time.Now()
		}
	}
}

// env is the configuration every instance of a scenario shares.
func env(t *testing.T, ps *pubsub, sup *supplier, target string, extra ...string) []string {
	return append([]string{
		"FUNCTION_TARGET=" + target,
		"DATASTORE_EMULATOR_HOST=" + testsvc.Datastore(t),
		"DATASTORE_PROJECT_ID=" + ps.project,
		"SUPPLIER_URL=" + sup.srv.URL,
		"IDEMPOTENCY_LEASE=3s",
	}, extra...)
}
