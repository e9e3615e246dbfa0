package bench

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Race runs b.N rounds; in each, racers goroutines call run on one fresh
// key at once, and the round ends when all have returned. It reports
// keys/s and the mean time a round took. run must count the bodies it
// ran; Race fails the benchmark when a round's run calls return errors.
func Race(b *testing.B, racers int, run func(key string) error) {
	b.Helper()
	start := time.Now()
	for i := 0; i < b.N; i++ {
		key := fmt.Sprintf("race-%d", i)
		var wg sync.WaitGroup
		errs := make(chan error, racers)
		for range racers {
			wg.Go(func() {
				if err := run(key); err != nil {
					errs <- err
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			b.Fatal(err)
		}
	}
	el := time.Since(start)
	b.ReportMetric(float64(b.N)/el.Seconds(), "keys/s")
}

// PurgeWhileClaiming runs purge once while claimers goroutines run claim
// on fresh keys, and reports the records purge removed per second and the
// claims' latency meanwhile (p50 and p99, in ms). want is how many records
// purge must remove.
func PurgeWhileClaiming(b *testing.B, want, claimers int, purge func() (int, error), claim func(key string) error) {
	b.Helper()
	var (
		stop    atomic.Bool
		mu      sync.Mutex
		lat     []time.Duration
		seq     atomic.Int64
		wg      sync.WaitGroup
		claimed atomic.Int64
	)
	for range claimers {
		wg.Go(func() {
			for !stop.Load() {
				t0 := time.Now()
				if err := claim(fmt.Sprintf("live-%d", seq.Add(1))); err != nil {
					b.Error(err)
					return
				}
				d := time.Since(t0)
				claimed.Add(1)
				mu.Lock()
				lat = append(lat, d)
				mu.Unlock()
			}
		})
	}
	start := time.Now()
	n, err := purge()
	el := time.Since(start)
	stop.Store(true)
	wg.Wait()
	if err != nil {
		b.Fatal(err)
	}
	if n != want {
		b.Fatalf("purge removed %d records, want %d", n, want)
	}
	b.ReportMetric(float64(n)/el.Seconds(), "purged/s")
	b.ReportMetric(float64(claimed.Load())/el.Seconds(), "claims/s")
	slices.Sort(lat)
	if len(lat) > 0 {
		b.ReportMetric(float64(lat[len(lat)/2])/1e6, "claim-p50-ms")
		b.ReportMetric(float64(lat[len(lat)*99/100])/1e6, "claim-p99-ms")
	}
}
