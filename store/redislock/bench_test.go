package redislock_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
)

// roundTrips counts the commands a client sends (a pipeline counts once).
type roundTrips struct{ n atomic.Int64 }

func (h *roundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *roundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() != "hello" && cmd.Name() != "client" {
			h.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (h *roundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmds)
	}
}

func noop(context.Context) error { return nil }

func TestSteadyStateIsTwoRoundTripsPerDelivery(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	rt := &roundTrips{}
	c.AddHook(rt)
	b := newBackend(t, c)
	ctx := t.Context()
	if err := idempotency.Lock(ctx, b, "warm-up", noop); err != nil { // loads the scripts if needed
		t.Fatal(err)
	}
	rt.n.Store(0)
	const n = 50
	for i := range n {
		if err := idempotency.Lock(ctx, b, fmt.Sprint("delivery-", i), noop); err != nil {
			t.Fatal(err)
		}
	}
	if got := rt.n.Load(); got != 2*n {
		t.Fatalf("%d round trips for %d deliveries, want exactly 2 each", got, n)
	}
	// A duplicate costs one.
	rt.n.Store(0)
	idempotency.Lock(ctx, b, "delivery-0", noop)
	if got := rt.n.Load(); got != 1 {
		t.Fatalf("a duplicate took %d round trips, want 1", got)
	}
}

// BenchmarkDelivery measures deliveries per second through Lock on a real
// redis-server against a baseline of two plain round trips (SET NX PX, then
// SET XX) per delivery, at 1 and 16 concurrent workers.
func BenchmarkDelivery(b *testing.B) {
	addr := testsvc.Redis(b)
	for _, workers := range []int{1, 16} {
		for _, kind := range []string{"baseline-2-round-trips", "lock"} {
			b.Run(fmt.Sprintf("%s/workers=%d", kind, workers), func(b *testing.B) {
				c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 32})
				defer c.Close()
				rt := &roundTrips{}
				c.AddHook(rt)
				be := newBackend(b, c)
				ctx := context.Background()
				prefix := fmt.Sprintf("%d:", time.Now().UnixNano()) // fresh keys each run
				run := func(key string) error {
					key = prefix + key
					if kind == "lock" {
						return idempotency.Lock(ctx, be, key, noop)
					}
					if err := c.SetNX(ctx, "base:"+key, "c", time.Minute).Err(); err != nil {
						return err
					}
					return c.SetXX(ctx, "base:"+key, "d", time.Hour).Err()
				}
				run("warm-up")
				rt.n.Store(0)
				bench.Deliveries(b, workers, run)
				b.ReportMetric(float64(rt.n.Load())/float64(b.N), "round-trips/delivery")
			})
		}
	}
}
