package main

import (
	"os"
	"strings"
	"testing"
)

// TestTableFromSavedOutput pins the table benchtable prints from go test
// output: ratios of deliveries/s (or of ns/op where a benchmark reports no
// rate) as the median of the rounds, each Lock beside every baseline of its
// group and worker count, a note row for a skipped backend or engine, and
// a failed benchmark reported as failed.
func TestTableFromSavedOutput(t *testing.T) {
	data, err := os.ReadFile("testdata/sample.txt")
	if err != nil {
		t.Fatal(err)
	}
	rows, failed := table(splitSaved(data))
	if !failed {
		t.Error("a failed benchmark did not fail the table")
	}
	got := render(rows)
	for _, want := range []string{
		// 10000/12500, 10000/11000, 10000/20000: median 0.8, range 0.5-0.91.
		"| wrapper (fake.Store) | BenchmarkDelivery/in-process | 1 | wrapped | 80000 | unwrapped | 100000 | **0.80x** | 0.50-0.91 | 57 allocs/op (+10), 9600 cpu-ns/op (1.20x the baseline's) |",
		"| Redis | BenchmarkDelivery | 1 | lock | 8000 | baseline-2-round-trips | 10000 | **0.80x** | 0.80-0.80 | 20 allocs/op (+11), 2 round-trips/delivery |",
		"| Redis | BenchmarkDelivery | 16 | lock | 19000 | baseline-2-round-trips | 20000 | **0.95x** |",
		"| SQL | BenchmarkDelivery/postgres | 1 | lock | 900 | baseline-2-writes | 1000 | **0.90x** |",
		"| SQL | not measured (skipped): BenchmarkDelivery/mysql: enginetest.go:40: mariadb not available; apt-get install mariadb-server |",
		"| Datastore | not measured (skipped): BenchmarkDelivery: bench_test.go:56: Datastore emulator not available",
		"| Spanner | failed: BenchmarkDelivery/lock/workers=1: bench_test.go:80: boom |",
		"| Firestore | BenchmarkDelivery | 1 | lock | 2000 | naive-2-transactions | 1000 | **2.00x** | 2.00-2.00 | 2 RPCs/delivery, 1270 allocs/op (-730) |",
		"| Firestore | stopped after 3m0s (the time budget, -timeout); the rows above are the runs that finished |",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("the table lacks\n%s\n\n%s", want, got)
		}
	}
}

func TestParseLine(t *testing.T) {
	r, ok := parseLine("BenchmarkDelivery/lock/workers=16-2   \t  100\t  5000 ns/op\t  200000 deliveries/s\t 3.000 RPCs/delivery")
	if !ok || r.name != "BenchmarkDelivery/lock/workers=16" || r.perSecond() != 200000 || r.metrics["RPCs/delivery"] != 3 {
		t.Fatalf("parseLine = %+v, %v", r, ok)
	}
	if g, k, w := split(r.name); g != "BenchmarkDelivery" || k != "lock" || w != 16 {
		t.Fatalf("split = %q %q %d", g, k, w)
	}
	if g, k, w := split("BenchmarkDelivery/in-process/wrapped"); g != "BenchmarkDelivery/in-process" || k != "wrapped" || w != 1 {
		t.Fatalf("split = %q %q %d", g, k, w)
	}
	for kind, want := range map[string]bool{"lock": true, "wrapped": true, "wrapped_duplicate": true, "wrapped_no_fingerprint": true,
		"unwrapped": false, "store-calls": false, "baseline-2-writes": false, "naive-2-transactions": false} {
		if measured(kind) != want {
			t.Errorf("measured(%q) = %v, want %v", kind, !want, want)
		}
	}
	for _, line := range []string{"BenchmarkDelivery/lock/workers=1", "--- SKIP: BenchmarkDelivery", "PASS", "BenchmarkX 10 abc ns/op"} {
		if _, ok := parseLine(line); ok {
			t.Errorf("parseLine(%q) took a header for a result", line)
		}
	}
}
