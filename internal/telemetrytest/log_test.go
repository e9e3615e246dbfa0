package telemetrytest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/pubsubtest"
)

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

// Every line the library writes within a delivery names the delivery's
// trace and span, as the handler's own lines do, so that Cloud Logging
// files them under the same request: the duplicate acknowledged, the key
// in progress elsewhere (503), the payload mismatch (409), an inner key
// in progress (503) and, through PushHandler, the failed delivery (500).
// On main the wrapper wrote these lines with the request's context, which
// has no span when the library's own span is the trace's root.
func TestEveryLibraryLogLineWithinADeliveryNamesItsTraceAndSpan(t *testing.T) {
	errBody := errors.New("supplier said no")
	cases := []struct {
		name  string
		push  bool
		setup func(t *testing.T, s *fake.Store, m *pubsubtest.Message) (idempotency.CloudEventFunc, []idempotency.Option)
		want  string // a part of the line's message
	}{
		{
			name: "duplicate acknowledged",
			setup: func(t *testing.T, s *fake.Store, m *pubsubtest.Message) (idempotency.CloudEventFunc, []idempotency.Option) {
				if err := idempotency.Lock(t.Context(), s, m.ID, func(context.Context) error { return nil }); err != nil {
					t.Fatal(err)
				}
				return nop, nil
			},
			want: "duplicate delivery acknowledged",
		},
		{
			name: "in progress elsewhere",
			setup: func(t *testing.T, s *fake.Store, m *pubsubtest.Message) (idempotency.CloudEventFunc, []idempotency.Option) {
				if _, err := s.Claim(t.Context(), m.ID, time.Hour); err != nil {
					t.Fatal(err)
				}
				return nop, nil
			},
			want: "key in progress elsewhere",
		},
		{
			name: "payload mismatch",
			setup: func(t *testing.T, s *fake.Store, m *pubsubtest.Message) (idempotency.CloudEventFunc, []idempotency.Option) {
				if err := idempotency.Lock(t.Context(), s, m.ID, func(context.Context) error { return nil }, idempotency.WithPayloadFingerprint("sha256:other")); err != nil {
					t.Fatal(err)
				}
				return nop, []idempotency.Option{idempotency.WithFingerprint(func(cloudevents.Event) (string, error) { return "sha256:this", nil })}
			},
			want: "completed by a different payload",
		},
		{
			name: "inner key in progress",
			setup: func(t *testing.T, s *fake.Store, m *pubsubtest.Message) (idempotency.CloudEventFunc, []idempotency.Option) {
				if _, err := s.Claim(t.Context(), "inner", time.Hour); err != nil {
					t.Fatal(err)
				}
				return func(ctx context.Context, _ cloudevents.Event) error {
					return idempotency.Lock(ctx, s, "inner", func(context.Context) error { return nil })
				}, nil
			},
			want: "inner key in progress elsewhere",
		},
		{
			name: "push delivery failed",
			push: true,
			setup: func(t *testing.T, s *fake.Store, m *pubsubtest.Message) (idempotency.CloudEventFunc, []idempotency.Option) {
				return func(context.Context, cloudevents.Event) error { return errBody }, nil
			},
			want: "push delivery failed",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			var buf bytes.Buffer
			logger := slog.New(idempotency.NewLogHandler(&buf, nil, idempotency.WithLogProject("p")))
			s := fake.New()
			m := &pubsubtest.Message{ID: pubsubtest.NewID(), Data: []byte(`{}`)}
			h, opts := tc.setup(t, s, m)
			for _, o := range append(r.opts(), idempotency.WithLogger(logger)) {
				opts = append(opts, o)
			}
			if tc.push {
				srv := httptest.NewServer(idempotency.PushHandler(s, h, opts...))
				defer srv.Close()
				resp, err := pubsubtest.Send(srv.URL, m.PushRequest())
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusInternalServerError {
					t.Fatalf("status %d, want 500", resp.StatusCode)
				}
			} else {
				_ = idempotency.Idempotent(s, opts...)(h)(context.Background(), m.Event())
			}
			call := named(t, r.spans(), "idempotency.lock")
			traceID, spanID := call.SpanContext().TraceID().String(), call.SpanContext().SpanID().String()
			found := false
			for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
				var got map[string]any
				if err := json.Unmarshal([]byte(line), &got); err != nil {
					t.Fatalf("log line %q: %v", line, err)
				}
				msg := fmt.Sprint(got["message"])
				if !strings.HasPrefix(msg, "idempotency:") {
					continue
				}
				if strings.Contains(msg, tc.want) {
					found = true
				}
				if got[idempotency.LogTraceKey] != "projects/p/traces/"+traceID || got[idempotency.LogSpanIDKey] != spanID {
					t.Errorf("line %q names trace %v span %v, want the delivery's %s/%s", msg, got[idempotency.LogTraceKey], got[idempotency.LogSpanIDKey], traceID, spanID)
				}
			}
			if !found {
				t.Fatalf("no line says %q; the log:\n%s", tc.want, buf.String())
			}
		})
	}
}

func nop(context.Context, cloudevents.Event) error { return nil }

// hookErr is a handler's error whose As method runs hook the first time it
// is called: the failure path after the wrapper's delivery has ended
// (nackable's errors.As), where a nested delivery the handler started with
// its context could still be running.
type hookErr struct {
	once sync.Once
	hook func()
}

func (e *hookErr) Error() string { return "supplier said no" }

func (e *hookErr) As(any) bool {
	e.once.Do(e.hook)
	return false
}

// A delivery that a handler runs with its own context (a fan-out to
// another guarded function, here one finishing after the handler
// returned, as a goroutine of the handler's would) does not rename the
// outer delivery's failure line: PushHandler's "push delivery failed" line
// names the outer delivery's span. On main the nested delivery found
// PushHandler's *context.Context in the handler's context and wrote its
// own span context through it, so the outer failure was filed under the
// nested delivery's span (and nested deliveries running in parallel
// wrote the pointer concurrently: a data race).
func TestANestedDeliveryDoesNotRenameThePushFailureLine(t *testing.T) {
	r := newRig(t)
	var buf bytes.Buffer
	logger := slog.New(idempotency.NewLogHandler(&buf, nil, idempotency.WithLogProject("p")))
	opts := []idempotency.Option{idempotency.WithLogger(logger)}
	for _, o := range r.opts() {
		opts = append(opts, o)
	}
	s := fake.New()
	outer := &pubsubtest.Message{ID: pubsubtest.NewID(), Data: []byte(`{}`)}
	inner := &pubsubtest.Message{ID: pubsubtest.NewID(), Data: []byte(`{}`)}
	nested := idempotency.Idempotent(s, opts...)(nop)
	var nestedErr error
	h := func(ctx context.Context, _ cloudevents.Event) error {
		return &hookErr{hook: func() { nestedErr = nested(ctx, inner.Event()) }}
	}
	srv := httptest.NewServer(idempotency.PushHandler(s, h, opts...))
	defer srv.Close()
	resp, err := pubsubtest.Send(srv.URL, outer.PushRequest())
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusInternalServerError {
		t.Fatalf("status %d, want 500", resp.StatusCode)
	}
	if nestedErr != nil {
		t.Fatalf("the nested delivery: %v", nestedErr)
	}
	var outerSpan, innerSpan string
	for _, s := range r.spans() {
		if s.Name() != "idempotency.lock" {
			continue
		}
		if outerSpan == "" {
			outerSpan = s.SpanContext().SpanID().String()
		} else {
			innerSpan = s.SpanContext().SpanID().String()
		}
	}
	if outerSpan == "" || innerSpan == "" {
		t.Fatalf("spans %v, want two idempotency.lock spans", names(r.spans()))
	}
	found := false
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var got map[string]any
		if err := json.Unmarshal([]byte(line), &got); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if !strings.Contains(fmt.Sprint(got["message"]), "push delivery failed") {
			continue
		}
		found = true
		if got[idempotency.LogSpanIDKey] != outerSpan {
			t.Errorf("the push failure line names span %v, want the outer delivery's %s (the nested one is %s)", got[idempotency.LogSpanIDKey], outerSpan, innerSpan)
		}
	}
	if !found {
		t.Fatalf("no push failure line; the log:\n%s", buf.String())
	}
}

// Guarded deliveries that a push handler runs in parallel with its
// context (a fan-out) each keep their own span: run under -race, this
// reported a data race on main, where each wrote PushHandler's
// *context.Context.
func TestParallelNestedDeliveriesUnderAPushDelivery(t *testing.T) {
	r := newRig(t)
	opts := []idempotency.Option{idempotency.WithLogger(discard)}
	for _, o := range r.opts() {
		opts = append(opts, o)
	}
	s := fake.New()
	nested := idempotency.Idempotent(s, opts...)(nop)
	h := func(ctx context.Context, _ cloudevents.Event) error {
		var wg sync.WaitGroup
		errs := make([]error, 8)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				m := &pubsubtest.Message{ID: pubsubtest.NewID(), Data: []byte(`{}`)}
				errs[i] = nested(ctx, m.Event())
			}()
		}
		wg.Wait()
		return errors.Join(errs...)
	}
	srv := httptest.NewServer(idempotency.PushHandler(s, h, opts...))
	defer srv.Close()
	m := &pubsubtest.Message{ID: pubsubtest.NewID(), Data: []byte(`{}`)}
	resp, err := pubsubtest.Send(srv.URL, m.PushRequest())
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("status %d, want 204", resp.StatusCode)
	}
	if n := len(r.spans()); n < 9 {
		t.Fatalf("%d spans, want the outer and 8 nested deliveries'", n)
	}
}
