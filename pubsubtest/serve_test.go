package pubsubtest_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"
	"github.com/google/go-cmp/cmp"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/pubsubtest"
)

// outcomes are a guarded function's ways to end, each set up on a fresh
// store for one message.
var outcomes = []struct {
	name  string
	setup func(t *testing.T, s *fake.Store, m *pubsubtest.Message) idempotency.CloudEventFunc
	want  int
}{
	{"processed", func(t *testing.T, s *fake.Store, m *pubsubtest.Message) idempotency.CloudEventFunc {
		return func(context.Context, cloudevents.Event) error { return nil }
	}, http.StatusOK},
	{"duplicate", func(t *testing.T, s *fake.Store, m *pubsubtest.Message) idempotency.CloudEventFunc {
		if err := idempotency.Lock(t.Context(), s, m.ID, func(context.Context) error { return nil }); err != nil {
			t.Fatal(err)
		}
		return func(context.Context, cloudevents.Event) error { t.Error("a duplicate ran"); return nil }
	}, http.StatusOK},
	{"in progress elsewhere", func(t *testing.T, s *fake.Store, m *pubsubtest.Message) idempotency.CloudEventFunc {
		if _, err := s.Claim(t.Context(), m.ID, time.Hour); err != nil {
			t.Fatal(err)
		}
		return func(context.Context, cloudevents.Event) error { return nil }
	}, http.StatusServiceUnavailable},
	{"handler failed", func(t *testing.T, s *fake.Store, m *pubsubtest.Message) idempotency.CloudEventFunc {
		return func(context.Context, cloudevents.Event) error { return errors.New("supplier said no") }
	}, http.StatusInternalServerError},
}

// guarded is Idempotent on s around h, logging nothing, keyed by
// messageId (or, with field, by that JSON field).
func guarded(s *fake.Store, h idempotency.CloudEventFunc, opts ...idempotency.Option) idempotency.CloudEventFunc {
	return idempotency.Idempotent(s, append(opts, idempotency.WithLogger(slog.New(slog.DiscardHandler)))...)(h)
}

// Status, for what a guarded function returns when called directly, is
// the status the functions framework answers the same delivery with.
func TestStatusIsWhatTheFrameworkAnswers(t *testing.T) {
	for _, o := range outcomes {
		t.Run(o.name, func(t *testing.T) {
			m := &pubsubtest.Message{ID: pubsubtest.NewID(), Data: []byte(`{"order":{"id":"A"}}`)}
			direct, wired := fake.New(), fake.New()
			got := pubsubtest.Status(guarded(direct, o.setup(t, direct, m))(t.Context(), m.Event()))
			serve(t, guarded(wired, o.setup(t, wired, m)))
			code, body := throughFramework(t, m.BinaryRequest())
			if got != code || got != o.want {
				t.Errorf("Status says %d, the framework answered %d (%s), want %d", got, code, body, o.want)
			}
		})
	}
	t.Run("malformed payload", func(t *testing.T) {
		m := &pubsubtest.Message{Data: []byte(`{"order":{"id":{"nested":1}}}`)}
		key := idempotency.WithKey(idempotency.JSONField("order", "id"))
		h := func(context.Context, cloudevents.Event) error { return nil }
		got := pubsubtest.Status(guarded(fake.New(), h, key)(t.Context(), m.Event()))
		serve(t, guarded(fake.New(), h, key))
		if code, body := throughFramework(t, m.BinaryRequest()); got != code || got != http.StatusBadRequest {
			t.Errorf("Status says %d, the framework answered %d (%s), want 400", got, code, body)
		}
	})
	if got := pubsubtest.Status(nil); got != http.StatusOK {
		t.Errorf("Status(nil) = %d, want 200", got)
	}
}

// NewServer answers each outcome with the framework's status, passes the
// function the event the framework passes, in both CloudEvent shapes,
// refuses a plain push envelope (415) without running the function,
// and stops when closed.
func TestNewServerServesAsTheFrameworkDoes(t *testing.T) {
	for _, shape := range []struct {
		name string
		req  func(m *pubsubtest.Message) *http.Request
	}{
		{"binary", (*pubsubtest.Message).BinaryRequest},
		{"structured", (*pubsubtest.Message).StructuredRequest},
	} {
		for _, o := range outcomes {
			t.Run(shape.name+"/"+o.name, func(t *testing.T) {
				m := &pubsubtest.Message{ID: pubsubtest.NewID(), Data: []byte(`{"order":{"id":"A"}}`), Attributes: map[string]string{"tenant": "t1"}}
				viaFramework, viaServer := &capture{}, &capture{}
				ff, own := fake.New(), fake.New()
				fh, sh := o.setup(t, ff, m), o.setup(t, own, m)
				serve(t, guarded(ff, func(ctx context.Context, e cloudevents.Event) error { viaFramework.handle(ctx, e); return fh(ctx, e) }))
				srv := pubsubtest.NewServer(guarded(own, func(ctx context.Context, e cloudevents.Event) error { viaServer.handle(ctx, e); return sh(ctx, e) }))
				defer srv.Close()
				want, _ := throughFramework(t, shape.req(m))
				resp, err := pubsubtest.Send(srv.URL, shape.req(m))
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != want || want != o.want {
					t.Errorf("NewServer answered %d (%s), the framework %d, want %d", resp.StatusCode, body, want, o.want)
				}
				if viaFramework.runs() != viaServer.runs() {
					t.Fatalf("the function ran %d times behind NewServer, %d behind the framework", viaServer.runs(), viaFramework.runs())
				}
				if viaServer.runs() == 1 {
					got, want := viaServer.only(t), viaFramework.only(t)
					if diff := cmp.Diff(want.String(), got.String()); diff != "" {
						t.Errorf("the event behind NewServer differs from the framework's (-framework +NewServer):\n%s", diff)
					}
				}
			})
		}
	}
	t.Run("push envelope", func(t *testing.T) {
		c := &capture{}
		srv := pubsubtest.NewServer(c.handle)
		resp, err := pubsubtest.Send(srv.URL, (&pubsubtest.Message{}).PushRequest())
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnsupportedMediaType || c.runs() != 0 {
			t.Errorf("a push envelope: %d with %d runs, want 415 and none", resp.StatusCode, c.runs())
		}
		srv.Close()
		if _, err := pubsubtest.Send(srv.URL, (&pubsubtest.Message{}).BinaryRequest()); err == nil {
			t.Error("the server still answers after Close")
		}
	})
}
