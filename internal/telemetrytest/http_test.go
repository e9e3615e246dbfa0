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
	"time"

	"github.com/GoogleCloudPlatform/functions-framework-go/funcframework"
	cloudevents "github.com/cloudevents/sdk-go/v2"
	"github.com/google/go-cmp/cmp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/ffserve"
	"github.com/gcp-pubsub-idempotency/idempotency/pubsubtest"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
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

// Through the real functions framework, the outcomes that a first
// delivery can also have: what goes on the wire, the outcome counted, and
// the call's span status (Error only for real failures).
func TestFunctionsFrameworkOutcomesOnTheWire(t *testing.T) {
	errStore := errors.New("store unreachable")
	cases := []struct {
		name      string
		setup     func(t *testing.T, msg *pubsubtest.Message) (store.Backend, idempotency.CloudEventFunc, []idempotency.Option)
		wantCode  int
		wantOut   string
		wantError bool
	}{
		{"in progress", func(t *testing.T, msg *pubsubtest.Message) (store.Backend, idempotency.CloudEventFunc, []idempotency.Option) {
			s := fake.New()
			if _, err := s.Claim(t.Context(), msg.ID, time.Hour); err != nil {
				t.Fatal(err)
			}
			return s, handler(new(bool)), nil
		}, http.StatusServiceUnavailable, idempotency.OutcomeInProgress, false},
		{"claim failed", func(t *testing.T, msg *pubsubtest.Message) (store.Backend, idempotency.CloudEventFunc, []idempotency.Option) {
			return backendFunc{claim: func(context.Context, string, time.Duration) (store.Result, error) {
				return store.Result{}, errStore
			}}, handler(new(bool)), nil
		}, http.StatusInternalServerError, idempotency.OutcomeClaimFailed, true},
		{"complete failed", func(t *testing.T, msg *pubsubtest.Message) (store.Backend, idempotency.CloudEventFunc, []idempotency.Option) {
			s := fake.New()
			b := backendFunc{claim: s.Claim, release: s.Release,
				complete: func(context.Context, store.Claim) (bool, error) { return false, errStore }}
			return b, handler(new(bool)), []idempotency.Option{idempotency.WithSettleTimeout(idempotency.MinSettleTimeout)}
		}, http.StatusOK, idempotency.OutcomeCompleteFailed, true},
		{"fenced out", func(t *testing.T, msg *pubsubtest.Message) (store.Backend, idempotency.CloudEventFunc, []idempotency.Option) {
			clock := fake.NewClock(epoch)
			s := fake.New(fake.WithClock(clock.Now))
			h := func(ctx context.Context, _ cloudevents.Event) error {
				clock.Advance(2 * time.Minute)
				if res, err := s.Claim(context.WithoutCancel(ctx), msg.ID, time.Minute); err != nil || res.Outcome != store.Won {
					t.Errorf("takeover: %v, %v", res.Outcome, err)
				}
				return nil
			}
			return s, h, []idempotency.Option{idempotency.WithLease(time.Minute)}
		}, http.StatusOK, idempotency.OutcomeFencedOut, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := newRig(t)
			msg := &pubsubtest.Message{ID: pubsubtest.NewID()}
			b, h, extra := c.setup(t, msg)
			opts := append([]idempotency.Option{idempotency.WithLogger(discard), idempotency.WithTracerProvider(r.tp), idempotency.WithMeterProvider(r.mp)}, extra...)
			serve(t, idempotency.Idempotent(b, opts...)(h))
			if code := deliver(t, serverURL, msg.BinaryRequest()); code != c.wantCode {
				t.Fatalf("HTTP %d, want %d", code, c.wantCode)
			}
			call := named(t, r.spans(), "idempotency.lock")
			if v, _ := attr(call, "idempotency.outcome"); v.AsString() != c.wantOut {
				t.Errorf("outcome %q, want %q", v.AsString(), c.wantOut)
			}
			if isErr := call.Status().Code == codes.Error; isErr != c.wantError {
				t.Errorf("call span status %v, want Error %v", call.Status(), c.wantError)
			}
			if got := r.collect(t)["idempotency.deliveries {delivery}"]; !cmp.Equal(got, map[string]int64{"idempotency.outcome=" + c.wantOut: 1}) {
				t.Errorf("deliveries %v", got)
			}
		})
	}
}

// Through the real functions framework, a message id redelivered with
// another payload: nacked with the 409 of a payload mismatch, counted as
// payload_mismatch, its call's span an Error.
func TestFunctionsFrameworkPayloadMismatchIsCounted(t *testing.T) {
	r := newRig(t)
	opts := []idempotency.Option{idempotency.WithLogger(discard), idempotency.WithTracerProvider(r.tp), idempotency.WithMeterProvider(r.mp)}
	serve(t, idempotency.Idempotent(fake.New(), opts...)(handler(new(bool))))
	id := pubsubtest.NewID()
	for i, c := range []struct {
		data string
		want int
	}{{`{"qty":1}`, http.StatusOK}, {`{"qty":999}`, http.StatusConflict}} {
		msg := &pubsubtest.Message{ID: id, Data: []byte(c.data)}
		if code := deliver(t, serverURL, msg.BinaryRequest()); code != c.want {
			t.Fatalf("delivery %d: HTTP %d, want %d", i+1, code, c.want)
		}
	}
	if diff := cmp.Diff([]string{"idempotency.lock", "idempotency.claim", "idempotency.body", "idempotency.complete", "idempotency.lock!", "idempotency.claim"}, names(r.spans())); diff != "" {
		t.Fatalf("spans (-want +got):\n%s", diff)
	}
	if got := r.collect(t)["idempotency.deliveries {delivery}"]; !cmp.Equal(got, map[string]int64{"idempotency.outcome=won": 1, "idempotency.outcome=payload_mismatch": 1}) {
		t.Errorf("deliveries %v", got)
	}
}
