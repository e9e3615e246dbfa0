package telemetrytest

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	cloudevents "github.com/cloudevents/sdk-go/v2"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/pubsubtest"
)

// The publisher's trace context, as Google's Pub/Sub client libraries put
// it in a message's attributes, and another one, as Cloud Run puts it in
// a request's traceparent header.
const (
	publisherTrace  = "4bf92f3577b34da6a3ce929d0e0e4736"
	publisherSpan   = "00f067aa0ba902b7"
	publisherParent = "00-" + publisherTrace + "-" + publisherSpan + "-01"
	requestTraceID  = "0af7651916cd43dd8448eb211c80319c"
	requestSpan     = "b7ad6b7169203331"
	requestParent   = "00-" + requestTraceID + "-" + requestSpan + "-01"
)

func tracedMessage() *pubsubtest.Message {
	return &pubsubtest.Message{Attributes: map[string]string{
		idempotency.MessageTraceAttributePrefix + "traceparent": publisherParent,
	}}
}

// seen records the span context the handler ran under.
type seen struct{ sc trace.SpanContext }

func (s *seen) handle(ctx context.Context, _ cloudevents.Event) error {
	s.sc = trace.SpanContextFromContext(ctx)
	return nil
}

// checkParent checks that the call's span continues traceID under the
// remote parent spanID, and that the handler ran in that trace.
func checkParent(t *testing.T, r *rig, h *seen, traceID, spanID string) {
	t.Helper()
	call := named(t, r.spans(), "idempotency.lock")
	p := call.Parent()
	if p.TraceID().String() != traceID || p.SpanID().String() != spanID || !p.IsRemote() {
		t.Errorf("the call's parent is %s/%s (remote %v), want %s/%s remote", p.TraceID(), p.SpanID(), p.IsRemote(), traceID, spanID)
	}
	if h.sc.TraceID().String() != traceID {
		t.Errorf("the handler ran in trace %s, want %s", h.sc.TraceID(), traceID)
	}
}

// Behind the functions framework, WithTraceFromMessage makes the
// publisher's span the parent of the delivery's spans; without it, the
// delivery starts a trace of its own (the framework passes the request's
// trace headers to no CloudEvent function).
func TestTraceFromMessageThroughTheFunctionsFramework(t *testing.T) {
	for _, withOption := range []bool{true, false} {
		r := newRig(t)
		h := &seen{}
		opts := []idempotency.Option{idempotency.WithLogger(discard), idempotency.WithTracerProvider(r.tp), idempotency.WithMeterProvider(r.mp)}
		if withOption {
			opts = append(opts, idempotency.WithTraceFromMessage())
		}
		serve(t, idempotency.Idempotent(fake.New(), opts...)(h.handle))
		req := tracedMessage().BinaryRequest()
		req.Header.Set("Traceparent", requestParent) // what Cloud Run adds; the framework drops it
		if code := deliver(t, serverURL, req); code != http.StatusOK {
			t.Fatalf("HTTP %d", code)
		}
		if withOption {
			checkParent(t, r, h, publisherTrace, publisherSpan)
			continue
		}
		if call := named(t, r.spans(), "idempotency.lock"); call.Parent().IsValid() {
			t.Errorf("without WithTraceFromMessage the call has parent %v", call.Parent())
		}
	}
}

// PushHandler reads the request's trace headers with the global
// propagator, once the program set one; that parent takes precedence over
// the message's.
func TestPushHandlerContinuesTheRequestsTrace(t *testing.T) {
	prev := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(propagation.TraceContext{})
	t.Cleanup(func() { otel.SetTextMapPropagator(prev) })
	for _, c := range []struct {
		name          string
		header        bool
		fromMessage   bool
		trace, parent string
	}{
		{"header", true, false, requestTraceID, requestSpan},
		{"header and message", true, true, requestTraceID, requestSpan},
		{"message", false, true, publisherTrace, publisherSpan},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newRig(t)
			h := &seen{}
			opts := []idempotency.Option{idempotency.WithLogger(discard), idempotency.WithTracerProvider(r.tp), idempotency.WithMeterProvider(r.mp)}
			if c.fromMessage {
				opts = append(opts, idempotency.WithTraceFromMessage())
			}
			srv := httptest.NewServer(idempotency.PushHandler(fake.New(), h.handle, opts...))
			defer srv.Close()
			req := tracedMessage().PushRequest()
			if c.header {
				req.Header.Set("Traceparent", requestParent)
			}
			if code := deliver(t, srv.URL, req); code != http.StatusNoContent {
				t.Fatalf("HTTP %d", code)
			}
			checkParent(t, r, h, c.trace, c.parent)
		})
	}
}
