package telemetrytest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"testing"

	"github.com/GoogleCloudPlatform/functions-framework-go/funcframework"
	cloudevents "github.com/cloudevents/sdk-go/v2"
	"github.com/google/go-cmp/cmp"
	"go.opentelemetry.io/otel"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/ffserve"
	"github.com/gcp-pubsub-idempotency/idempotency/pubsubtest"
)

// One functions-framework server per test binary, serving whichever
// function the running test installed.
var (
	serverURL string
	mu        sync.Mutex
	function  idempotency.CloudEventFunc
)

func TestMain(m *testing.M) {
	os.Unsetenv("FUNCTION_TARGET")
	dispatch := func(ctx context.Context, e cloudevents.Event) error {
		mu.Lock()
		f := function
		mu.Unlock()
		return f(ctx, e)
	}
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

// serve installs f as the framework's function for the rest of the test.
func serve(t *testing.T, f idempotency.CloudEventFunc) {
	mu.Lock()
	function = f
	mu.Unlock()
	t.Cleanup(func() {
		mu.Lock()
		function = nil
		mu.Unlock()
	})
}

// deliver sends r to the server at base and returns the status.
func deliver(t *testing.T, base string, r *http.Request) int {
	t.Helper()
	resp, err := pubsubtest.Send(base, r)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// handler returns a CloudEvent function that fails while *fail is set.
func handler(fail *bool) idempotency.CloudEventFunc {
	return func(context.Context, cloudevents.Event) error {
		if *fail {
			return errors.New("supplier down")
		}
		return nil
	}
}

// Through the real functions framework: a failed delivery, its
// redelivery that wins, and a duplicate, each traced and counted, each
// call's spans in one trace.
func TestFunctionsFrameworkDeliveriesAreTracedAndCounted(t *testing.T) {
	r := newRig(t)
	fail := true
	opts := []idempotency.Option{idempotency.WithLogger(discard)}
	for _, o := range r.opts() {
		opts = append(opts, o)
	}
	serve(t, idempotency.Idempotent(fake.New(), opts...)(handler(&fail)))
	msg := &pubsubtest.Message{Data: []byte(`{"order":"PO-1"}`)}
	if code := deliver(t, serverURL, msg.BinaryRequest()); code != http.StatusInternalServerError {
		t.Fatalf("failing delivery: HTTP %d", code)
	}
	fail = false
	for i, want := range []int{http.StatusOK, http.StatusOK} { // the redelivery, then a duplicate
		if code := deliver(t, serverURL, msg.BinaryRequest()); code != want {
			t.Fatalf("delivery %d: HTTP %d, want %d", i+2, code, want)
		}
	}
	checkThreeDeliveries(t, r)
}

// The same through PushHandler, with raw push envelopes.
func TestPushHandlerDeliveriesAreTracedAndCounted(t *testing.T) {
	r := newRig(t)
	fail := true
	opts := []idempotency.Option{idempotency.WithLogger(discard)}
	for _, o := range r.opts() {
		opts = append(opts, o)
	}
	srv := httptest.NewServer(idempotency.PushHandler(fake.New(), handler(&fail), opts...))
	defer srv.Close()
	msg := &pubsubtest.Message{Data: []byte(`{"order":"PO-1"}`)}
	if code := deliver(t, srv.URL, msg.PushRequest()); code != http.StatusInternalServerError {
		t.Fatalf("failing delivery: HTTP %d", code)
	}
	fail = false
	for i, want := range []int{http.StatusNoContent, http.StatusNoContent} {
		if code := deliver(t, srv.URL, msg.PushRequest()); code != want {
			t.Fatalf("delivery %d: HTTP %d, want %d", i+2, code, want)
		}
	}
	checkThreeDeliveries(t, r)
}

func checkThreeDeliveries(t *testing.T, r *rig) {
	t.Helper()
	spans := r.spans()
	want := []string{
		"idempotency.lock!", "idempotency.claim", "idempotency.body!", "idempotency.release",
		"idempotency.lock", "idempotency.claim", "idempotency.body", "idempotency.complete",
		"idempotency.lock", "idempotency.claim",
	}
	if diff := cmp.Diff(want, names(spans)); diff != "" {
		t.Fatalf("spans (-want +got):\n%s", diff)
	}
	var outcomes []string
	for _, s := range spans {
		if s.Name() != "idempotency.lock" {
			continue
		}
		v, _ := attr(s, "idempotency.outcome")
		outcomes = append(outcomes, v.AsString())
	}
	if diff := cmp.Diff([]string{"failed", "won", "duplicate"}, outcomes); diff != "" {
		t.Errorf("outcomes (-want +got):\n%s", diff)
	}
	// Each call's spans form one trace, rooted at the call's span.
	var root = spans[0]
	for _, s := range spans {
		if s.Name() == "idempotency.lock" {
			root = s
			if s.Parent().IsValid() {
				t.Errorf("the call's span has a parent %v, but the request carried none", s.Parent())
			}
			continue
		}
		if s.SpanContext().TraceID() != root.SpanContext().TraceID() || s.Parent().SpanID() != root.SpanContext().SpanID() {
			t.Errorf("%s is not a child of its call's span", s.Name())
		}
	}
	got := r.collect(t)["idempotency.deliveries {delivery}"]
	if diff := cmp.Diff(map[string]int64{
		"idempotency.outcome=failed": 1, "idempotency.outcome=won": 1, "idempotency.outcome=duplicate": 1,
	}, got); diff != "" {
		t.Errorf("deliveries (-want +got):\n%s", diff)
	}
}

// With no provider option, the global providers are used, looked up on
// every delivery: providers set after Idempotent was called, and set
// again later, receive the spans and metrics of the deliveries that
// follow.
func TestGlobalProvidersSetLaterAreUsed(t *testing.T) {
	f := idempotency.Idempotent(fake.New(), idempotency.WithLogger(discard))(handler(new(bool)))
	serve(t, f)
	for i := range 2 {
		r := newRig(t)
		otel.SetTracerProvider(r.tp)
		otel.SetMeterProvider(r.mp)
		msg := &pubsubtest.Message{}
		if code := deliver(t, serverURL, msg.BinaryRequest()); code != http.StatusOK {
			t.Fatalf("HTTP %d", code)
		}
		if diff := cmp.Diff([]string{"idempotency.lock", "idempotency.claim", "idempotency.body", "idempotency.complete"}, names(r.spans())); diff != "" {
			t.Fatalf("provider %d: spans (-want +got):\n%s", i+1, diff)
		}
		if got := r.collect(t)["idempotency.deliveries {delivery}"]; !cmp.Equal(got, map[string]int64{"idempotency.outcome=won": 1}) {
			t.Fatalf("provider %d: deliveries %v", i+1, got)
		}
	}
}
