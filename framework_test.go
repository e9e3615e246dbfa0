package idempotency_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/GoogleCloudPlatform/functions-framework-go/funcframework"
	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/ffserve"
)

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

func TestHTTPEveryFixtureShapeIsKeyedByMessageID(t *testing.T) {
	for _, name := range []string{"eventarc_binary", "eventarc_structured", "push_raw"} {
		t.Run(name, func(t *testing.T) {
			s, _ := newStore(t)
			h := &counting{}
			serve(t, idempotency.Idempotent(s)(h.handle))
			if code, body := post(t, name); code != http.StatusOK {
				t.Fatalf("first delivery: %d %s", code, body)
			}
			if _, ok := s.Record("11223344556677"); !ok {
				t.Fatal("no record under the messageId")
			}
			if code, body := post(t, name); code != http.StatusOK {
				t.Fatalf("redelivery: %d %s, want 200 (ack)", code, body)
			}
			if h.runs() != 1 {
				t.Fatalf("handler ran %d times, want 1", h.runs())
			}
		})
	}
}

func TestHTTPDoubleSubscriptionProcessesOnce(t *testing.T) {
	// Eventarc's subscription and a plain push subscription on the same topic
	// deliver the same publish: one messageId, one run.
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s)(h.handle))
	for _, name := range []string{"eventarc_binary", "push_raw", "eventarc_structured"} {
		if code, body := post(t, name); code != http.StatusOK {
			t.Fatalf("%s: %d %s", name, code, body)
		}
	}
	if h.runs() != 1 {
		t.Fatalf("handler ran %d times across two subscriptions, want 1", h.runs())
	}
}

func TestHTTPHandlerErrorIs500AndTheRetrySucceeds(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{err: fmt.Errorf("supplier said 502")}
	serve(t, idempotency.Idempotent(s)(h.handle))
	if code, _ := post(t, "eventarc_binary"); code != http.StatusInternalServerError || returned() != h.err {
		t.Fatalf("failing handler: %d %v, want 500 and the handler's own error", code, returned())
	}
	h.mu.Lock()
	h.err = nil
	h.mu.Unlock()
	if code, _ := post(t, "eventarc_binary"); code != http.StatusOK {
		t.Fatalf("retry: %d", code)
	}
	if code, _ := post(t, "eventarc_binary"); code != http.StatusOK {
		t.Fatalf("duplicate after success: %d", code)
	}
	if h.runs() != 2 {
		t.Fatalf("runs = %d, want 2 (the failure and the success)", h.runs())
	}
}

func TestHTTPContentionIsAQuiet503WithTheDeliveryAttempt(t *testing.T) {
	s, _ := newStore(t)
	l, logger := newLogs()
	if _, err := s.Claim(t.Context(), "11223344556677", time.Hour); err != nil { // a live holder elsewhere
		t.Fatal(err)
	}
	h := &counting{}
	serve(t, idempotency.Idempotent(s, idempotency.WithLogger(logger))(h.handle))
	code, body := post(t, "eventarc_binary")
	if code != http.StatusServiceUnavailable || !errors.Is(returned(), idempotency.ErrInProgress) {
		t.Fatalf("contended delivery: %d %s %v, want 503 wrapping ErrInProgress", code, body, returned())
	}
	if h.runs() != 0 {
		t.Fatal("the handler ran under contention")
	}
	warns := l.find(t, "WARN", "in progress elsewhere")
	if len(warns) != 1 {
		t.Fatalf("want one warning, got %v", l.records(t))
	}
	w := warns[0]
	if w["key"] != "11223344556677" || w["delivery_attempt"] != float64(5) ||
		!strings.HasPrefix(w["subscription"].(string), "projects/my-project/subscriptions/") || w["until"] == nil {
		t.Fatalf("warning lacks key, delivery_attempt, subscription or until: %v", w)
	}
	if errs := l.find(t, "ERROR", ""); len(errs) != 0 {
		t.Fatalf("contention logged errors: %v", errs)
	}
}

func TestHTTPUnkeyedFailsClosedUnlessAllowed(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s)(h.handle))
	code, _ := post(t, "unkeyed")
	if code/100 == 2 || !errors.Is(returned(), idempotency.ErrNoKey) {
		t.Fatalf("unkeyed: %d %v, want a non-2xx and ErrNoKey", code, returned())
	}
	if h.runs() != 0 || s.Len() != 0 {
		t.Fatalf("runs=%d records=%d, want none", h.runs(), s.Len())
	}
	l, logger := newLogs()
	serve(t, idempotency.Idempotent(s, idempotency.AllowUnguarded(), idempotency.WithLogger(logger))(h.handle))
	if code, body := post(t, "unkeyed"); code != http.StatusOK {
		t.Fatalf("unkeyed with AllowUnguarded: %d %s", code, body)
	}
	if h.runs() != 1 || s.Len() != 0 || len(l.find(t, "WARN", "unguarded")) != 1 {
		t.Fatalf("runs=%d records=%d logs=%v; want 1 unguarded run with a warning", h.runs(), s.Len(), l.records(t))
	}
}

func TestHTTPMalformedDataIsRefused(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s, idempotency.AllowUnguarded())(h.handle))
	code, _ := post(t, "malformed")
	if code/100 == 2 || !errors.Is(returned(), idempotency.ErrMalformedEvent) {
		t.Fatalf("malformed: %d %v, want a non-2xx and ErrMalformedEvent", code, returned())
	}
	if h.runs() != 0 {
		t.Fatal("the handler ran on malformed data, even with AllowUnguarded")
	}
}

func TestHTTPBusinessKeyCatchesARepublish(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s,
		idempotency.WithKey(idempotency.Attribute("po_id")),
		idempotency.WithKeyPrefix("orders:"),
	)(h.handle))
	for _, name := range []string{"eventarc_binary", "republish"} {
		if code, body := post(t, name); code != http.StatusOK {
			t.Fatalf("%s: %d %s", name, code, body)
		}
	}
	if h.runs() != 1 {
		t.Fatalf("handler ran %d times for one order published twice, want 1", h.runs())
	}
	if _, ok := s.Record("orders:PO-1001"); !ok {
		t.Fatal("no record under the prefixed business key")
	}
}

func TestHTTPMessageIDDoesNotCatchARepublish(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s)(h.handle))
	post(t, "eventarc_binary")
	post(t, "republish")
	if h.runs() != 2 {
		t.Fatalf("runs = %d: a republish has a new messageId and is a new delivery to the default key", h.runs())
	}
}
