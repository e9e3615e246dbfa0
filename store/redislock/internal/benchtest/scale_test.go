package benchtest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// usedMemory reads INFO memory's used_memory, in bytes.
func usedMemory(b *testing.B, c *redis.Client) int64 {
	b.Helper()
	info, err := c.Info(context.Background(), "memory").Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			return n
		}
	}
	b.Fatal("INFO memory has no used_memory")
	return 0
}

// BenchmarkLiveRecords completes b.N deliveries through Lock, each on a
// key of its own ("idempotency:" + 24 bytes, the length of a Pub/Sub
// message id and more), with 64 workers, and reports how much the
// server's used_memory grew per record, and the records' total, all of
// them live (done, within the ttl). Run it with -benchtime 1000000x for a
// million records. It flushes nothing: give it a server of its own
// (REDIS_ADDR unset starts one).
func BenchmarkLiveRecords(b *testing.B) {
	addr := testsvc.Redis(b)
	c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 64})
	defer c.Close()
	be, err := redislock.New(c, redislock.WithPrefix(fmt.Sprintf("idempotency:%x:", time.Now().UnixNano()%0xfff)))
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	var wg sync.WaitGroup
	for i := range 64 { // open the pool's connections (their buffers are not records)
		wg.Go(func() {
			if err := idempotency.Lock(ctx, be, fmt.Sprint("warm-up-", i), noop); err != nil {
				b.Error(err)
			}
		})
	}
	wg.Wait()
	before := usedMemory(b, c)
	var seq atomic.Int64
	b.ResetTimer()
	for range 64 {
		wg.Go(func() {
			for {
				i := seq.Add(1)
				if i > int64(b.N) {
					return
				}
				if err := idempotency.Lock(ctx, be, fmt.Sprintf("%020d", i), noop); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	grew := usedMemory(b, c) - before
	b.ReportMetric(float64(grew)/float64(b.N), "bytes/record")
	b.ReportMetric(float64(grew)/(1<<20), "MiB-total")
}

// BenchmarkRacingDeliveries has n deliveries of one key race (n
// goroutines call Lock at once on a fresh key, as a redelivery storm
// would): one runs the body, the others get ErrDuplicate or
// ErrInProgress. One op is one race; it reports the time per race and
// per delivery, and fails if the body ran other than once.
func BenchmarkRacingDeliveries(b *testing.B) {
	addr := testsvc.Redis(b)
	for _, n := range []int{1, 4, 16, 64} {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: max(32, n)})
			defer c.Close()
			be, err := redislock.New(c, redislock.WithPrefix(fmt.Sprintf("race:%d:", time.Now().UnixNano())))
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			if err := idempotency.Lock(ctx, be, "warm-up", noop); err != nil {
				b.Fatal(err)
			}
			var losers atomic.Int64
			b.ResetTimer()
			for i := range b.N {
				key := fmt.Sprint(i)
				var ran atomic.Int64
				var wg sync.WaitGroup
				start := make(chan struct{})
				for range n {
					wg.Go(func() {
						<-start
						err := idempotency.Lock(ctx, be, key, func(context.Context) error { ran.Add(1); return nil })
						switch {
						case err == nil:
						case errors.Is(err, idempotency.ErrDuplicate), errors.Is(err, idempotency.ErrInProgress):
							losers.Add(1)
						default:
							b.Error(err)
						}
					})
				}
				close(start)
				wg.Wait()
				if ran.Load() != 1 {
					b.Fatalf("race %d: the body ran %d times, want once", i, ran.Load())
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/delivery")
			b.ReportMetric(float64(losers.Load())/float64(b.N), "turned-away/race")
		})
	}
}
