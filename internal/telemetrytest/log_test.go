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
