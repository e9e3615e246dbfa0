package benchtest

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	bsm "github.com/bsm/redislock"
	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testsvc.StopAll()
	os.Exit(code)
}

// commands counts the commands a client sends (a pipeline counts once):
// each is one round trip.
type commands struct{ n atomic.Int64 }

func (h *commands) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *commands) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() != "hello" && cmd.Name() != "client" {
			h.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (h *commands) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmds)
	}
}

func noop(context.Context) error { return nil }

// kinds are the ways of running one delivery that BenchmarkDelivery sets
// side by side, on one server, in one run.
var kinds = []struct {
	name string
	// setup returns a delivery on client c, whose keys all start with
	// prefix.
	setup func(b *testing.B, c *redis.Client, prefix string) func(ctx context.Context, key string) error
}{
	{"baseline-2-round-trips", func(b *testing.B, c *redis.Client, prefix string) func(context.Context, string) error {
		// Two plain writes, the floor of any lock with a claim and a
		// completion: SET NX PX, then SET XX PX.
		return func(ctx context.Context, key string) error {
			if err := c.SetNX(ctx, prefix+key, "c", time.Minute).Err(); err != nil {
				return err
			}
			return c.SetXX(ctx, prefix+key, "d", time.Hour).Err()
		}
	}},
	{"bsm-obtain-release", func(b *testing.B, c *redis.Client, prefix string) func(context.Context, string) error {
		// github.com/bsm/redislock: Obtain (SET NX PX with a random
		// token), the work, Release (a script comparing the token, DEL).
		locker := bsm.New(c)
		return func(ctx context.Context, key string) error {
			l, err := locker.Obtain(ctx, prefix+key, time.Minute, nil)
			if err != nil {
				return err
			}
			return l.Release(ctx)
		}
	}},
	{"bsm-obtain-release-done", func(b *testing.B, c *redis.Client, prefix string) func(context.Context, string) error {
		// What a user of github.com/bsm/redislock needs for the dedupe
		// Lock gives: Obtain, the work, a done marker kept for the ttl
		// (a plain SET PX, as Lock's done record is kept for its ttl),
		// Release. Still without the checks Lock makes: no fence, no
		// server clock for the lease, no look at the marker before
		// Obtain.
		locker := bsm.New(c)
		return func(ctx context.Context, key string) error {
			l, err := locker.Obtain(ctx, prefix+key, time.Minute, nil)
			if err != nil {
				return err
			}
			if err := c.Set(ctx, prefix+"done:"+key, "d", 24*time.Hour).Err(); err != nil {
				return err
			}
			return l.Release(ctx)
		}
	}},
	{"backend-claim-complete", func(b *testing.B, c *redis.Client, prefix string) func(context.Context, string) error {
		// The backend alone, without Lock: what Lock itself costs is
		// lock's time less this one's.
		be, err := redislock.New(c, redislock.WithPrefix(prefix))
		if err != nil {
			b.Fatal(err)
		}
		return func(ctx context.Context, key string) error {
			r, err := be.Claim(ctx, key, time.Minute)
			if err != nil {
				return err
			}
			_, err = be.Complete(ctx, r.Claim)
			return err
		}
	}},
	{"lock", func(b *testing.B, c *redis.Client, prefix string) func(context.Context, string) error {
		be, err := redislock.New(c, redislock.WithPrefix(prefix))
		if err != nil {
			b.Fatal(err)
		}
		return func(ctx context.Context, key string) error {
			return idempotency.Lock(ctx, be, key, noop)
		}
	}},
}

// BenchmarkDelivery measures deliveries per second on one redis-server,
// each kind beside the others at each number of concurrent workers:
// idempotency.Lock on redislock (lock), two plain writes
// (baseline-2-round-trips), bsm/redislock's Obtain and Release
// (bsm-obtain-release), the same with a done marker set between them
// (bsm-obtain-release-done) and redislock's Claim and Complete without Lock
// (backend-claim-complete). Every delivery uses a fresh key. Only ratios
// between kinds of one run mean anything.
func BenchmarkDelivery(b *testing.B) {
	addr := testsvc.Redis(b)
	for _, workers := range []int{1, 4, 16, 64} {
		for _, k := range kinds {
			b.Run(fmt.Sprintf("%s/workers=%d", k.name, workers), func(b *testing.B) {
				c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: max(32, workers)})
				defer c.Close()
				cmds := &commands{}
				c.AddHook(cmds)
				ctx := context.Background()
				run := k.setup(b, c, fmt.Sprintf("bench:%d:", time.Now().UnixNano()))
				if err := run(ctx, "warm-up"); err != nil { // loads the scripts
					b.Fatal(err)
				}
				cmds.n.Store(0)
				b.ResetTimer()
				bench.Deliveries(b, workers, func(key string) error { return run(ctx, key) })
				b.ReportMetric(float64(cmds.n.Load())/float64(b.N), "round-trips/delivery")
			})
		}
	}
}

// BenchmarkInterleaved runs the kinds of BenchmarkDelivery by turns, a
// burst of deliveries each, at each number of workers, so that a machine
// whose load drifts (a shared CI runner) slows every kind alike, and
// reports each kind's deliveries/s and lock's ratio to each baseline
// (x-baseline, x-bsm: lock's deliveries/s over theirs; above 1 is faster).
// One op is one round of bursts.
func BenchmarkInterleaved(b *testing.B) {
	addr := testsvc.Redis(b)
	const burst = 64
	for _, workers := range []int{1, 4, 16, 64} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: max(32, workers)})
			defer c.Close()
			ctx := context.Background()
			runs := make([]func(context.Context, string) error, len(kinds))
			for i, k := range kinds {
				runs[i] = k.setup(b, c, fmt.Sprintf("inter:%d:%d:", time.Now().UnixNano(), i))
				if err := runs[i](ctx, "warm-up"); err != nil {
					b.Fatal(err)
				}
			}
			spent := make([]time.Duration, len(kinds))
			var seq atomic.Int64
			b.ResetTimer()
			for range b.N {
				for i, run := range runs {
					start := time.Now()
					var wg sync.WaitGroup
					var left atomic.Int64
					left.Store(burst)
					for range workers {
						wg.Go(func() {
							for left.Add(-1) >= 0 {
								if err := run(ctx, fmt.Sprint(seq.Add(1))); err != nil {
									b.Error(err)
									return
								}
							}
						})
					}
					wg.Wait()
					spent[i] += time.Since(start)
				}
			}
			rate := func(i int) float64 { return float64(b.N*burst) / spent[i].Seconds() }
			for i, k := range kinds {
				b.ReportMetric(rate(i), k.name+"/s")
			}
			at := func(name string) int {
				for i, k := range kinds {
					if k.name == name {
						return i
					}
				}
				panic(name)
			}
			lock := at("lock")
			b.ReportMetric(rate(lock)/rate(at("baseline-2-round-trips")), "x-baseline")
			b.ReportMetric(rate(lock)/rate(at("bsm-obtain-release")), "x-bsm")
		})
	}
}
