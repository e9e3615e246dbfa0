package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/pubsubtest"
)

// BenchmarkOptionCost measures what each option adds to one fresh delivery
// on fake.Store (claim + complete, no I/O), against the same delivery with
// the defaults in the same run: through the CloudEvents HTTP handler in
// process for Idempotent's options ("idempotent/..."), and through
// PushHandler for its own ("push/..."). Every request carries a 10-minute
// deadline, as the functions framework gives one, so WithLeaseFromDeadline
// has one to size the lease from. Run it with -count 5 or more and compare
// each row with its group's "defaults" row: on fake.Store the wrapper is
// everything, so these are the largest ratios an option can show; against a
// real backend's round trips they shrink towards 1.
func BenchmarkOptionCost(b *testing.B) {
	withDeadline := func(r *http.Request) (*http.Request, context.CancelFunc) {
		ctx, cancel := context.WithTimeout(r.Context(), 10*time.Minute)
		return r.WithContext(ctx), cancel
	}
	run := func(b *testing.B, h http.Handler, request func(id string) *http.Request) {
		b.ReportAllocs()
		defer bench.CPU(b)()
		i := 0
		for b.Loop() {
			i++
			req, cancel := withDeadline(request(strconv.Itoa(i)))
			w := httptest.NewRecorder()
			h.ServeHTTP(w, req)
			cancel()
			if w.Code/100 != 2 {
				b.Fatalf("status %d: %s", w.Code, w.Body)
			}
		}
	}
	message := func(id string) *pubsubtest.Message {
		return &pubsubtest.Message{
			ID:         id,
			Data:       []byte(`{"order":{"id":"PO-` + id + `","qty":1}}`),
			Attributes: map[string]string{"po_id": "PO-" + id, "origin": "bench"},
		}
	}
	quietly := idempotency.WithLogger(quiet)
	for _, c := range []struct {
		name string
		opts []idempotency.Option
	}{
		{"defaults", nil},
		{"WithFingerprint(nil)", []idempotency.Option{idempotency.WithFingerprint(nil)}},
		{"WithFingerprint(PayloadFingerprint(po_id))", []idempotency.Option{idempotency.WithFingerprint(idempotency.PayloadFingerprint("po_id"))}},
		{"WithKey(Attribute(po_id))", []idempotency.Option{idempotency.WithKey(idempotency.Attribute("po_id"))}},
		{"WithKey(JSONField(order,id))", []idempotency.Option{idempotency.WithKey(idempotency.JSONField("order", "id"))}},
		{"WithKeyPrefix", []idempotency.Option{idempotency.WithKeyPrefix("orders:")}},
		{"WithHashedKeys", []idempotency.Option{idempotency.WithHashedKeys()}},
		{"WithHeartbeat(1m)", []idempotency.Option{idempotency.WithHeartbeat(time.Minute)}},
		{"WithLeaseFromDeadline(1m)", []idempotency.Option{idempotency.WithLeaseFromDeadline(time.Minute)}},
		{"WithTraceFromMessage", []idempotency.Option{idempotency.WithTraceFromMessage()}},
	} {
		b.Run("idempotent/"+c.name, func(b *testing.B) {
			h := receiver(b, idempotency.Idempotent(fake.New(), append([]idempotency.Option{quietly}, c.opts...)...)(noop))
			run(b, h, func(id string) *http.Request { return message(id).BinaryRequest() })
		})
	}
	for _, c := range []struct {
		name    string
		opts    []idempotency.Option
		request func(m *pubsubtest.Message) *http.Request
	}{
		{"defaults", nil, (*pubsubtest.Message).PushRequest},
		{"WithPushAuth", []idempotency.Option{idempotency.WithPushAuth(func(*http.Request) error { return nil })}, (*pubsubtest.Message).PushRequest},
		{"WithUnwrappedPush(po_id)", []idempotency.Option{idempotency.WithUnwrappedPush("po_id")},
			func(m *pubsubtest.Message) *http.Request { return m.UnwrappedRequest(true) }},
	} {
		b.Run("push/"+c.name, func(b *testing.B) {
			h := idempotency.PushHandler(fake.New(), noop, append([]idempotency.Option{quietly}, c.opts...)...)
			run(b, h, func(id string) *http.Request { return c.request(message(id)) })
		})
	}
}
