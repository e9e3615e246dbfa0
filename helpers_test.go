package idempotency_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/GoogleCloudPlatform/functions-framework-go/funcframework"
	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/ffserve"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var epoch = time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)

// newStore returns a fake store on a manual clock.
func newStore(t *testing.T) (*fake.Store, *fake.Clock) {
	t.Helper()
	clock := fake.NewClock(epoch)
	return fake.New(fake.WithClock(clock.Now)), clock
}

// logs captures slog output as parsed JSON records.
type logs struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func newLogs() (*logs, *slog.Logger) {
	l := &logs{}
	return l, slog.New(slog.NewJSONHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func (l *logs) records(t *testing.T) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(l.buf.Bytes()))
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("log line %q: %v", sc.Text(), err)
		}
		out = append(out, m)
	}
	return out
}

// find returns the records at level whose message contains substr.
func (l *logs) find(t *testing.T, level, substr string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, r := range l.records(t) {
		if r["level"] == level && strings.Contains(r["msg"].(string), substr) {
			out = append(out, r)
		}
	}
	return out
}

// backendFunc adapts functions to store.Backend for fault tests of our own
// logic; the contract itself is proven against real backends.
type backendFunc struct {
	claim    func(ctx context.Context, key string, lease time.Duration) (store.Result, error)
	complete func(ctx context.Context, c store.Claim) (bool, error)
	release  func(ctx context.Context, c store.Claim) error
}

func (b backendFunc) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	return b.claim(ctx, key, lease)
}

func (b backendFunc) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return b.complete(ctx, c)
}

func (b backendFunc) Release(ctx context.Context, c store.Claim) error { return b.release(ctx, c) }

// untouchable fails the test on any backend call.
func untouchable(t *testing.T) store.Backend {
	fail := func() { t.Errorf("the backend was called") }
	return backendFunc{
		claim: func(context.Context, string, time.Duration) (store.Result, error) {
			fail()
			return store.Result{}, nil
		},
		complete: func(context.Context, store.Claim) (bool, error) { fail(); return false, nil },
		release:  func(context.Context, store.Claim) error { fail(); return nil },
	}
}

// One real functions-framework server per test binary, serving a function
// that dispatches to whichever handler the running test installed.
var (
	serverURL string
	serveMu   sync.Mutex // one test at a time owns the server
	handlerMu sync.RWMutex
	handler   idempotency.CloudEventFunc
	owner     testing.TB
	lastErr   error
)

func dispatch(ctx context.Context, e cloudevents.Event) error {
	handlerMu.RLock()
	h := handler
	handlerMu.RUnlock()
	err := h(ctx, e)
	handlerMu.Lock()
	lastErr = err
	handlerMu.Unlock()
	return err
}

// returned is what the served function returned for the last delivery.
func returned() error {
	handlerMu.RLock()
	defer handlerMu.RUnlock()
	return lastErr
}

func TestMain(m *testing.M) {
	os.Unsetenv("FUNCTION_TARGET")
	if err := funcframework.RegisterCloudEventFunctionContext(context.Background(), "/", dispatch); err != nil {
		fmt.Fprintln(os.Stderr, "register:", err)
		os.Exit(2)
	}
	url, _, err := ffserve.Start("")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	serverURL = url
	os.Exit(m.Run())
}

// serve installs h as the framework's function. The first call in a test
// takes the server for the rest of that test; later calls swap the handler.
func serve(t testing.TB, h idempotency.CloudEventFunc) {
	handlerMu.Lock()
	mine := owner == t
	handlerMu.Unlock()
	if !mine {
		serveMu.Lock()
		t.Cleanup(func() {
			handlerMu.Lock()
			owner = nil
			handlerMu.Unlock()
			serveMu.Unlock()
		})
	}
	handlerMu.Lock()
	owner, handler = t, h
	handlerMu.Unlock()
}

// fixture reads testdata/name.http as a request for the test server.
func fixture(t testing.TB, name string) (*http.Request, []byte) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", name+".http"))
	if err != nil {
		t.Fatal(err)
	}
	head, body, ok := bytes.Cut(raw, []byte("\n\n"))
	if !ok {
		t.Fatalf("%s: no blank line after the headers", name)
	}
	req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(append(head, "\n\n"...))))
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return req, bytes.TrimRight(body, "\n")
}

// post sends the fixture to the framework and returns the status and body.
func post(t testing.TB, name string) (int, string) {
	t.Helper()
	return postTo(t, serverURL, name)
}

// postTo sends the fixture to the server at base and returns the status
// and body.
func postTo(t testing.TB, base, name string) (int, string) {
	t.Helper()
	tmpl, body := fixture(t, name)
	req, err := http.NewRequest(tmpl.Method, base+tmpl.RequestURI, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header = tmpl.Header
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// counting returns a handler that counts its runs and records the events.
type counting struct {
	mu     sync.Mutex
	events []cloudevents.Event
	err    error
}

func (c *counting) handle(ctx context.Context, e cloudevents.Event) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.events = append(c.events, e)
	return c.err
}

func (c *counting) runs() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.events)
}

// send posts body with the given headers to h and returns the status.
func send(t *testing.T, h http.Handler, body string, head map[string]string) int {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(body))
	for k, v := range head {
		r.Header.Set(k, v)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w.Code
}

// The messageId of the fixtures in testdata/.
const fixtureID = "11223344556677"

// completeSubKey marks key done on s, as an earlier delivery's inner Lock
// would have.
func completeSubKey(t *testing.T, s store.Backend, key string) {
	t.Helper()
	if err := idempotency.Lock(t.Context(), s, key, func(context.Context) error { return nil }); err != nil {
		t.Fatal(err)
	}
}

// nestedDuplicate is a handler body that runs an inner Lock on a sub-key
// that is already done, and returns (wrapped) what the inner Lock said: the
// handler RAN, and failed.
func nestedDuplicate(s store.Backend, ran *int) idempotency.CloudEventFunc {
	return func(ctx context.Context, e cloudevents.Event) error {
		*ran++
		err := idempotency.Lock(ctx, s, "po:PO-1", func(context.Context) error { return nil })
		return fmt.Errorf("reserving stock: %w", err)
	}
}

// assertReleased checks that the message key is Claimed with a bumped fence
// (released by a failing body), not Done.
func assertReleased(t *testing.T, s *fake.Store, key string) {
	t.Helper()
	rec, ok := s.Record(key)
	if !ok || rec.State != store.Claimed || rec.Fence != 2 {
		t.Fatalf("record %q = %+v (present %v), want released (claimed, fence 2): the body failed", key, rec, ok)
	}
}

// pubsubAcks are the push response statuses Pub/Sub counts as an ack.
var pubsubAcks = map[int]bool{102: true, 200: true, 201: true, 202: true, 204: true}

// pushTo posts a fixture to a PushHandler server.
func pushTo(t *testing.T, url, name string) int {
	t.Helper()
	code, _ := postTo(t, url, name)
	return code
}

// pubsubEvent builds a Pub/Sub CloudEvent with the given message fields.
func pubsubEvent(t *testing.T, id string, message map[string]any) cloudevents.Event {
	t.Helper()
	e := cloudevents.NewEvent()
	e.SetID(id)
	e.SetSource("//pubsub.googleapis.com/projects/p/topics/t")
	e.SetType(idempotency.PubSubEventType)
	if err := e.SetData(cloudevents.ApplicationJSON, map[string]any{"message": message}); err != nil {
		t.Fatal(err)
	}
	return e
}

func payload(v any) string {
	b, _ := json.Marshal(v)
	return base64.StdEncoding.EncodeToString(b)
}

func newDiscard() *slog.Logger { _, l := newLogs(); return l }
