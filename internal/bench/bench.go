// Package bench runs the backends' delivery benchmarks the same way.
package bench

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Deliveries calls run b.N times with distinct keys, from one goroutine or
// from workers goroutines (b.SetParallelism over GOMAXPROCS), and reports
// deliveries/s.
func Deliveries(b *testing.B, workers int, run func(key string) error) {
	b.Helper()
	var seq atomic.Int64
	start := time.Now()
	if workers <= 1 {
		for i := 0; i < b.N; i++ {
			if err := run(fmt.Sprint(i)); err != nil {
				b.Fatal(err)
			}
		}
	} else {
		b.SetParallelism(max(1, workers/2))
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := run(fmt.Sprint(seq.Add(1))); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "deliveries/s")
}

// CPU starts measuring the CPU time the whole process spends (every
// goroutine: the server's, the collector's) and returns the function that
// reports it per operation as cpu-ns/op. On a shared machine CPU time
// moves less than elapsed time with what else runs there. Call it after
// the set-up, and the returned function before b returns.
func CPU(b *testing.B) (report func()) {
	start, ok := processCPU()
	return func() {
		end, ok2 := processCPU()
		if ok && ok2 && b.N > 0 {
			b.ReportMetric(float64(end-start)/float64(b.N), "cpu-ns/op")
		}
	}
}

// Warm runs n deliveries on each of workers goroutines at once, with keys
// of its own, before a benchmark's timer starts: it opens the connections
// the workers will use and takes each past its first executions of a
// statement (PostgreSQL plans a prepared statement afresh for each of its
// first five executions on a connection), so that the benchmark measures
// the steady state a long-running consumer is in.
func Warm(b *testing.B, workers, n int, run func(key string) error) {
	b.Helper()
	var wg sync.WaitGroup
	for w := range max(1, workers) {
		wg.Go(func() {
			for i := range n {
				if err := run(fmt.Sprintf("warm-up-%d-%d", w, i)); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
}
