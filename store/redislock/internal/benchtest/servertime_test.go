package benchtest

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
)

// sent records the names of the commands a client sends: the commands
// whose server time is the delivery's (a script's own commands are counted
// by INFO commandstats too, inside the script's time).
type sent struct {
	mu    sync.Mutex
	names map[string]bool
}

func (h *sent) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *sent) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.mu.Lock()
		h.names[strings.ToLower(cmd.Name())] = true
		h.mu.Unlock()
		return next(ctx, cmd)
	}
}

func (h *sent) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.mu.Lock()
		for _, cmd := range cmds {
			h.names[strings.ToLower(cmd.Name())] = true
		}
		h.mu.Unlock()
		return next(ctx, cmds)
	}
}

// serverStats reads INFO commandstats (usec per command name) and the
// server's CPU time (used_cpu_user + used_cpu_sys, in µs).
func serverStats(b *testing.B, c *redis.Client) (usec map[string]int64, cpu float64) {
	b.Helper()
	info, err := c.Info(context.Background(), "commandstats", "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	usec = map[string]int64{}
	for _, line := range strings.Split(info, "\n") {
		line = strings.TrimSpace(line)
		if rest, ok := strings.CutPrefix(line, "cmdstat_"); ok {
			name, fields, _ := strings.Cut(rest, ":")
			for _, f := range strings.Split(fields, ",") {
				if v, ok := strings.CutPrefix(f, "usec="); ok {
					n, err := strconv.ParseInt(v, 10, 64)
					if err != nil {
						b.Fatal(err)
					}
					usec[name] = n
				}
			}
		}
		for _, p := range []string{"used_cpu_user:", "used_cpu_sys:"} {
			if v, ok := strings.CutPrefix(line, p); ok {
				s, err := strconv.ParseFloat(v, 64)
				if err != nil {
					b.Fatal(err)
				}
				cpu += s * 1e6
			}
		}
	}
	return usec, cpu
}

// BenchmarkServerTime runs each kind of BenchmarkDelivery and reports
// what the deliveries cost the server, figures that move far less with
// the machine's load than deliveries/s: server-us/delivery, the INFO
// commandstats time of the commands the client sent (a script's time
// includes its own commands'), and server-cpu-us/delivery, the server
// process's CPU time (used_cpu_user + used_cpu_sys: commands, I/O and the
// event loop). Give it a server of its own (REDIS_ADDR unset starts one):
// it resets the server's statistics.
func BenchmarkServerTime(b *testing.B) {
	addr := testsvc.Redis(b)
	for _, workers := range []int{1, 16} {
		for _, k := range kinds {
			b.Run(fmt.Sprintf("impl=%s/workers=%d", k.name, workers), func(b *testing.B) {
				c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: max(32, workers)})
				defer c.Close()
				ctx := context.Background()
				run := k.setup(b, c, fmt.Sprintf("st:%d:", time.Now().UnixNano()))
				if err := run(ctx, "warm-up"); err != nil { // loads the scripts
					b.Fatal(err)
				}
				names := &sent{names: map[string]bool{}}
				c.AddHook(names)
				if err := c.ConfigResetStat(ctx).Err(); err != nil {
					b.Fatal(err)
				}
				_, cpu0 := serverStats(b, c)
				b.ResetTimer()
				bench.Deliveries(b, workers, func(key string) error { return run(ctx, key) })
				b.StopTimer()
				usec, cpu1 := serverStats(b, c)
				var total int64
				for name := range names.names {
					if name != "config" && name != "info" {
						total += usec[name]
					}
				}
				b.ReportMetric(float64(total)/float64(b.N), "server-us/delivery")
				b.ReportMetric((cpu1-cpu0)/float64(b.N), "server-cpu-us/delivery")
			})
		}
	}
}
