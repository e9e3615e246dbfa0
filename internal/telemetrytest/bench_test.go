package telemetrytest

import (
	"context"
	"fmt"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/telemetryswitch"
)

// discardExporter drops every span it is handed.
type discardExporter struct{}

func (discardExporter) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardExporter) Shutdown(context.Context) error                             { return nil }

// BenchmarkTelemetry measures one delivery through Lock on fake.Store (a
// fresh key: claim, body, complete) side by side: without any telemetry
// (the baseline), with the default global providers while none is set
// (the API's no-op), and with SDK providers: every span sampled and
// batched to an exporter that drops it, or none sampled (a parent-based
// ratio sampler at 0, as a low ratio mostly is), metrics aggregated by a
// reader that is never collected. Run it alone (-run '^$'): a test that
// sets the global providers would change the "default" case.
func BenchmarkTelemetry(b *testing.B) {
	for _, c := range telemetryCases(b) {
		b.Run(c.name, func(b *testing.B) {
			telemetryswitch.Off.Store(c.off)
			defer telemetryswitch.Off.Store(false)
			s := fake.New()
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			bench.Deliveries(b, 1, func(key string) error {
				return idempotency.Lock(ctx, s, key, noopBody, c.opts...)
			})
		})
	}
}

// BenchmarkTelemetryInterleaved pairs each case of BenchmarkTelemetry
// with the baseline ("none"): every iteration runs one delivery of each,
// in turn, so that a machine whose load changes during the run slows both
// alike. It reports the time per delivery of both and their ratio.
func BenchmarkTelemetryInterleaved(b *testing.B) {
	cases := telemetryCases(b)
	for _, c := range cases[1:] {
		b.Run(c.name, func(b *testing.B) {
			pair := []telemetryCase{cases[0], c}
			stores := []*fake.Store{fake.New(), fake.New()}
			var spent [2]time.Duration
			ctx := context.Background()
			defer telemetryswitch.Off.Store(false)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				key := fmt.Sprint(i)
				for j, c := range pair {
					telemetryswitch.Off.Store(c.off)
					start := time.Now()
					if err := idempotency.Lock(ctx, stores[j], key, noopBody, c.opts...); err != nil {
						b.Fatal(err)
					}
					spent[j] += time.Since(start)
				}
			}
			b.ReportMetric(float64(spent[0].Nanoseconds())/float64(b.N), "ns/none")
			b.ReportMetric(float64(spent[1].Nanoseconds())/float64(b.N), "ns/"+c.name)
			b.ReportMetric(float64(spent[1])/float64(spent[0]), "x")
		})
	}
}

func noopBody(context.Context) error { return nil }

type telemetryCase struct {
	name string
	off  bool
	opts []idempotency.LockOption
}

func telemetryCases(b *testing.B) []telemetryCase {
	sdk := func(s sdktrace.Sampler) []idempotency.LockOption {
		tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(s), sdktrace.WithBatcher(discardExporter{}))
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
		b.Cleanup(func() {
			_ = tp.Shutdown(context.Background())
			_ = mp.Shutdown(context.Background())
		})
		return []idempotency.LockOption{idempotency.WithTracerProvider(tp), idempotency.WithMeterProvider(mp)}
	}
	return []telemetryCase{
		{"none", true, nil},
		{"default-noop", false, nil},
		{"sdk-sampled", false, sdk(sdktrace.AlwaysSample())},
		{"sdk-unsampled", false, sdk(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(0)))},
	}
}
