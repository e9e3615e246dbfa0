package telemetrytest

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// rig is an SDK tracer provider and meter provider whose spans and
// metrics stay in memory for the test to read.
type rig struct {
	rec    *tracetest.SpanRecorder
	tp     *sdktrace.TracerProvider
	reader *sdkmetric.ManualReader
	mp     *sdkmetric.MeterProvider
}

func newRig(t *testing.T) *rig {
	t.Helper()
	r := &rig{rec: tracetest.NewSpanRecorder(), reader: sdkmetric.NewManualReader()}
	r.tp = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(r.rec))
	r.mp = sdkmetric.NewMeterProvider(sdkmetric.WithReader(r.reader))
	t.Cleanup(func() {
		_ = r.tp.Shutdown(context.Background())
		_ = r.mp.Shutdown(context.Background())
	})
	return r
}

// opts sends the spans and metrics of a call to the rig.
func (r *rig) opts() []idempotency.LockOption {
	return []idempotency.LockOption{idempotency.WithTracerProvider(r.tp), idempotency.WithMeterProvider(r.mp)}
}

// spans returns the ended spans in the order they started.
func (r *rig) spans() []sdktrace.ReadOnlySpan {
	s := r.rec.Ended()
	sort.SliceStable(s, func(i, j int) bool { return s[i].StartTime().Before(s[j].StartTime()) })
	return s
}

// names returns the names of spans, each followed by "!" when its status
// is Error.
func names(spans []sdktrace.ReadOnlySpan) []string {
	var out []string
	for _, s := range spans {
		n := s.Name()
		if s.Status().Code == codes.Error {
			n += "!"
		}
		out = append(out, n)
	}
	return out
}

// attr returns the value of the attribute key on s, and whether s has it.
func attr(s sdktrace.ReadOnlySpan, key string) (attribute.Value, bool) {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

// named returns the first span called name.
func named(t *testing.T, spans []sdktrace.ReadOnlySpan, name string) sdktrace.ReadOnlySpan {
	t.Helper()
	for _, s := range spans {
		if s.Name() == name {
			return s
		}
	}
	t.Fatalf("no span %q among %v", name, names(spans))
	return nil
}

// collect reads the rig's metrics: for each instrument, the count (a
// counter's sum, a histogram's count) of each attribute set, written
// "k=v,k=v" in key order.
func (r *rig) collect(t *testing.T) map[string]map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		if sm.Scope.Name != idempotency.InstrumentationName {
			t.Errorf("scope %q", sm.Scope.Name)
		}
		for _, m := range sm.Metrics {
			byAttrs := map[string]int64{}
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					byAttrs[attrString(p.Attributes)] += p.Value
				}
			case metricdata.Histogram[float64]:
				for _, p := range d.DataPoints {
					byAttrs[attrString(p.Attributes)] += int64(p.Count)
				}
			default:
				t.Fatalf("%s: unexpected data %T", m.Name, m.Data)
			}
			out[m.Name+" "+m.Unit] = byAttrs
		}
	}
	return out
}

func attrString(s attribute.Set) string {
	var parts []string
	for _, kv := range s.ToSlice() {
		parts = append(parts, fmt.Sprintf("%s=%s", kv.Key, kv.Value.String()))
	}
	return strings.Join(parts, ",")
}

// backendFunc adapts functions to store.Backend, for faults.
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

// keyFree checks the rule of WithKeyInSpans: without it, no span carries
// any of keys (the key as stored, the key as the KeyFunc found it)
// anywhere: not in its name, an attribute, an event's name or
// attributes, its status description, or a link's attributes.
func keyFree(t *testing.T, spans []sdktrace.ReadOnlySpan, keys ...string) {
	t.Helper()
	has := func(where, s string, sp sdktrace.ReadOnlySpan) {
		for _, k := range keys {
			if strings.Contains(s, k) {
				t.Errorf("%s: %s %q carries the key %q without WithKeyInSpans", sp.Name(), where, s, k)
			}
		}
	}
	attrs := func(where string, kvs []attribute.KeyValue, sp sdktrace.ReadOnlySpan) {
		for _, kv := range kvs {
			has(where+" attribute "+string(kv.Key)+" key", string(kv.Key), sp)
			has(where+" attribute "+string(kv.Key), kv.Value.String(), sp)
		}
	}
	for _, s := range spans {
		has("name", s.Name(), s)
		attrs("span", s.Attributes(), s)
		for _, e := range s.Events() {
			has("event name", e.Name, s)
			attrs("event "+e.Name, e.Attributes, s)
		}
		has("status description", s.Status().Description, s)
		for _, l := range s.Links() {
			attrs("link", l.Attributes, s)
		}
	}
}
