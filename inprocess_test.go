package idempotency_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A wrapper built on fake.Store in a Cloud Run service warns once, at
// start-up; off Cloud Run, or on a shared backend, it says nothing.
func TestInProcessBackendOnCloudRunWarnsAtStartUp(t *testing.T) {
	h := func(context.Context, cloudevents.Event) error { return nil }
	shared := struct{ store.Backend }{fake.New()} // hides InProcess, as a real backend has none
	cases := []struct {
		name    string
		service string
		b       store.Backend
		build   func(b store.Backend, l *slog.Logger)
		warns   bool
	}{
		{"Idempotent on fake.Store on Cloud Run", "orders", fake.New(), func(b store.Backend, l *slog.Logger) {
			idempotency.Idempotent(b, idempotency.WithLogger(l))(h)
		}, true},
		{"PushHandler on fake.Store on Cloud Run", "orders", fake.New(), func(b store.Backend, l *slog.Logger) {
			idempotency.PushHandler(b, h, idempotency.WithLogger(l))
		}, true},
		{"IdempotentTx on fake.TxStore on Cloud Run", "orders", nil, func(_ store.Backend, l *slog.Logger) {
			idempotency.IdempotentTx[int](fake.NewTx[int](fake.New(), func(context.Context) (int, error) { return 0, nil }, func(int) error { return nil }, func(int) error { return nil }), idempotency.WithLogger(l))
		}, true},
		{"Idempotent on fake.Store off Cloud Run", "", fake.New(), func(b store.Backend, l *slog.Logger) {
			idempotency.Idempotent(b, idempotency.WithLogger(l))(h)
		}, false},
		{"Idempotent on a shared backend on Cloud Run", "orders", shared, func(b store.Backend, l *slog.Logger) {
			idempotency.Idempotent(b, idempotency.WithLogger(l))(h)
		}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("K_SERVICE", tc.service)
			var buf bytes.Buffer
			tc.build(tc.b, slog.New(slog.NewTextHandler(&buf, nil)))
			got := strings.Count(buf.String(), "keeps its records in this process's memory")
			if want := map[bool]int{true: 1, false: 0}[tc.warns]; got != want {
				t.Fatalf("%d warnings, want %d; the log:\n%s", got, want, buf.String())
			}
			if tc.warns && !strings.Contains(buf.String(), "service=orders") {
				t.Errorf("the warning does not name the service:\n%s", buf.String())
			}
		})
	}
}
