package realtest

import (
	"context"
	"log/slog"
	"strconv"
	"sync/atomic"
	"testing"

	"cloud.google.com/go/pubsub/v2"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/pubsubtest"
	"github.com/gcp-pubsub-idempotency/idempotency/pull"
)

// BenchmarkPullCallback measures, on one redis-server, the Receive
// callback of a guarded handler (pull.Handler on redislock: claim,
// handler, complete, ack) beside a bare callback that makes the two plain
// writes a hand-rolled guard would (SET NX, then SET) before the same
// handler and ack. Each message is new (a fresh id): no duplicates. The
// messages are built in the benchmark, so no Pub/Sub round trip is
// measured. cpu-ns/op is the CPU time of the whole process (the callback,
// the client), which moves less with the machine's load than the time
// per delivery. Run with -count and compare the two with benchstat.
func BenchmarkPullCallback(b *testing.B) {
	addr := testsvc.Redis(b)
	client := redis.NewClient(&redis.Options{Addr: addr})
	b.Cleanup(func() { _ = client.Close() })
	var seq atomic.Int64
	next := func() *pubsub.Message {
		return &pubsub.Message{ID: strconv.FormatInt(seq.Add(1), 10), Data: []byte(`{"order":{"id":1}}`), Attributes: map[string]string{"source": "bench"}}
	}
	handle := func(context.Context, *pubsub.Message) error { return nil }
	ctx := context.Background()

	b.Run("impl=guarded", func(b *testing.B) {
		// As docs/pull.md advises: the lease follows the client's
		// extension of the ack deadline.
		cb := pull.Handler(nil, newRedis(b), handle, idempotency.WithLogger(slog.New(slog.DiscardHandler)), idempotency.WithLeaseFromDeadline(0))
		b.ReportAllocs()
		cpu := bench.CPU(b)
		for b.Loop() {
			cb(ctx, next())
		}
		cpu()
	})
	b.Run("impl=push-wrapper", func(b *testing.B) {
		// The push path's guard on the same store and options, given the
		// CloudEvent the functions framework would build of the same
		// message: what the pull adapter adds is the difference.
		fn := idempotency.Idempotent(newRedis(b), idempotency.WithLogger(slog.New(slog.DiscardHandler)), idempotency.WithLeaseFromDeadline(0))(
			func(context.Context, event.Event) error { return nil })
		b.ReportAllocs()
		cpu := bench.CPU(b)
		for b.Loop() {
			m := next()
			msg := pubsubtest.Message{ID: m.ID, Data: m.Data, Attributes: m.Attributes}
			if err := fn(ctx, msg.Event()); err != nil {
				b.Fatal(err)
			}
		}
		cpu()
	})
	b.Run("impl=bare-2-writes", func(b *testing.B) {
		prefix := "bench-bare-" + strconv.FormatInt(seq.Add(1), 10) + ":"
		b.ReportAllocs()
		cpu := bench.CPU(b)
		for b.Loop() {
			m := next()
			if err := client.SetNX(ctx, prefix+m.ID, "claimed", 0).Err(); err != nil {
				b.Fatal(err)
			}
			if err := handle(ctx, m); err != nil {
				b.Fatal(err)
			}
			if err := client.Set(ctx, prefix+m.ID, "done", 0).Err(); err != nil {
				b.Fatal(err)
			}
			if _, err := m.AckWithResult().Get(ctx); err != nil {
				b.Fatal(err)
			}
		}
		cpu()
	})
}
