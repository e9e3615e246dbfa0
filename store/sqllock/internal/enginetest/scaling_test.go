package enginetest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// How cost grows (docs/scaling/sql.md). These benchmarks are run by hand:
//
//	go test -run '^$' -bench BenchmarkGrowth -benchtime 2048x -count 2 github.com/gcp-pubsub-idempotency/idempotency/store/sqllock/internal/enginetest
//	go test -run '^$' -bench BenchmarkRacingOneKey -benchtime 2s github.com/gcp-pubsub-idempotency/idempotency/store/sqllock/internal/enginetest
//	go test -run '^$' -bench BenchmarkMillionRecords -benchtime 1x -timeout 60m github.com/gcp-pubsub-idempotency/idempotency/store/sqllock/internal/enginetest

// BenchmarkGrowth is BenchmarkDelivery's lock beside its writes baseline
// at 1, 4, 16 and 64 concurrent workers: what one delivery costs as the
// load grows. The two kinds run by turns of 256 deliveries in one process,
// so a load that drifts on a shared machine slows both alike; it reports
// each kind's deliveries/s and lock/plain, the ratio of the two.
func BenchmarkGrowth(b *testing.B) {
	noop := func(context.Context) error { return nil }
	kinds := []string{"baseline-2-writes", "lock"}
	for _, e := range engines {
		dsn := e.dsn(b)
		for _, workers := range []int{1, 4, 16, 64} {
			b.Run(fmt.Sprintf("%s/workers=%d", e.name, workers), func(b *testing.B) {
				db := e.open(b, dsn, nil)
				runs := make([]func(string) error, len(kinds))
				for i, kind := range kinds {
					runs[i] = deliveryRun(b, e, db, kind, noop)
					if err := runs[i]("warm-up"); err != nil {
						b.Fatal(err)
					}
				}
				elapsed := make([]time.Duration, len(kinds))
				b.ResetTimer()
				for done := 0; done < b.N; {
					n := min(256, b.N-done)
					for i, run := range runs {
						t := time.Now()
						if err := turn(workers, done, n, run); err != nil {
							b.Fatal(err)
						}
						elapsed[i] += time.Since(t)
					}
					done += n
				}
				b.StopTimer()
				for i, kind := range kinds {
					b.ReportMetric(float64(b.N)/elapsed[i].Seconds(), kind+"-deliveries/s")
				}
				b.ReportMetric(elapsed[0].Seconds()/elapsed[1].Seconds(), "lock/plain")
			})
		}
	}
}

// turn runs deliveries first to first+n-1 with run, from workers
// goroutines.
func turn(workers, first, n int, run func(string) error) error {
	var next atomic.Int64
	next.Store(int64(first))
	end := int64(first + n)
	var wg sync.WaitGroup
	var failed atomic.Value
	for range min(workers, n) {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= end {
					return
				}
				if err := run(strconv.FormatInt(i, 10)); err != nil {
					failed.Store(err)
					return
				}
			}
		})
	}
	wg.Wait()
	err, _ := failed.Load().(error)
	return err
}

// BenchmarkRacingOneKey: n deliveries of one key at once (a fresh key per
// iteration), each through Lock with an empty body: one wins and completes,
// the others find it held or done. An iteration is one race; µs/delivery
// is the mean time each delivery took to get its answer.
func BenchmarkRacingOneKey(b *testing.B) {
	noop := func(context.Context) error { return nil }
	for _, e := range engines {
		dsn := e.dsn(b)
		for _, n := range []int{2, 16, 64} {
			b.Run(fmt.Sprintf("%s/n=%d", e.name, n), func(b *testing.B) {
				db := e.open(b, dsn, nil)
				be := e.backend(b, db)
				ctx := context.Background()
				prefix := fmt.Sprint(time.Now().UnixNano(), ":")
				var total atomic.Int64
				var won atomic.Int64
				b.ResetTimer()
				for i := range b.N {
					key := fmt.Sprint(prefix, i)
					start := make(chan struct{})
					var wg sync.WaitGroup
					for range n {
						wg.Go(func() {
							<-start
							t0 := time.Now()
							err := idempotency.Lock(ctx, be, key, noop)
							total.Add(int64(time.Since(t0)))
							switch {
							case err == nil:
								won.Add(1)
							case errors.Is(err, idempotency.ErrDuplicate), errors.Is(err, idempotency.ErrInProgress):
							default:
								b.Error(err)
							}
						})
					}
					close(start)
					wg.Wait()
				}
				b.StopTimer()
				if won.Load() != int64(b.N) {
					b.Fatalf("%d wins in %d races, want one each", won.Load(), b.N)
				}
				b.ReportMetric(float64(total.Load())/float64(b.N*n)/1e3, "µs/delivery")
			})
		}
	}
}

// BenchmarkMillionRecords fills a table with 10^6 records (keys shaped
// like Pub/Sub message ids, a claim token each, expired), reports the
// table's and its indexes' size, purges half of them with PurgeExpired
// alone, then the other half while 4 workers run deliveries on fresh keys
// of the same table, and reports the purge's rates and the deliveries'
// latency before and during the second purge. Run it with -benchtime 1x: an iteration is the whole experiment.
//
// SQLLOCK_RECORDS sets another number of records (for a quick look).
func BenchmarkMillionRecords(b *testing.B) {
	records := 1_000_000
	if s := os.Getenv("SQLLOCK_RECORDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			b.Fatalf("SQLLOCK_RECORDS=%q: want a positive number", s)
		}
		records = n
	}
	for _, e := range engines {
		b.Run(e.name, func(b *testing.B) {
			for range b.N {
				millionRecords(b, e, records)
			}
		})
	}
}

func millionRecords(b *testing.B, e engine, records int) {
	ctx := context.Background()
	db := e.open(b, e.dsn(b), nil)
	be := e.backend(b, db)
	table := tableOf(be)
	t0 := time.Now()
	fill(b, e, db, table, records)
	b.Logf("%s: filled %d records in %v", e.name, records, time.Since(t0).Round(time.Millisecond))
	data, index := sizes(b, e, db, table)
	b.Logf("%s: %d bytes of table, %d of indexes", e.name, data, index)
	b.ReportMetric(float64(data), "table-bytes")
	b.ReportMetric(float64(index), "index-bytes")
	b.ReportMetric(float64(data+index)/float64(records), "bytes/record")

	// Half the records purged with nothing else running.
	t0 = time.Now()
	alone, err := be.PurgeExpired(ctx, records/2)
	tookAlone := time.Since(t0)
	b.Logf("%s: purged %d alone in %v (%v)", e.name, alone, tookAlone.Round(time.Millisecond), err)
	if err != nil || alone != records/2 {
		b.Fatalf("purged %d alone (%v), want %d", alone, err, records/2)
	}
	b.ReportMetric(float64(alone)/tookAlone.Seconds(), "purged/s-alone")

	// The other half while deliveries run on fresh keys, timed one by
	// one, from 4 workers.
	var (
		mu      sync.Mutex
		phase   = "idle"
		latency = map[string][]time.Duration{}
		stop    atomic.Bool
		wg      sync.WaitGroup
		seq     atomic.Int64
		failed  atomic.Value
	)
	noop := func(context.Context) error { return nil }
	for range 4 {
		wg.Go(func() {
			for !stop.Load() {
				key := fmt.Sprint("live-", seq.Add(1))
				t := time.Now()
				if err := idempotency.Lock(ctx, be, key, noop); err != nil {
					failed.Store(err)
					return
				}
				d := time.Since(t)
				mu.Lock()
				latency[phase] = append(latency[phase], d)
				mu.Unlock()
			}
		})
	}
	time.Sleep(3 * time.Second) // deliveries alone, for the idle latency
	mu.Lock()
	phase = "purging"
	mu.Unlock()
	t0 = time.Now()
	n, err := be.PurgeExpired(ctx, 0)
	took := time.Since(t0)
	b.Logf("%s: purged %d in %v (%v)", e.name, n, took.Round(time.Millisecond), err)
	mu.Lock()
	phase = "after"
	mu.Unlock()
	stop.Store(true)
	wg.Wait()
	if err != nil {
		b.Fatal(err)
	}
	if err, _ := failed.Load().(error); err != nil {
		b.Fatal(err)
	}
	if n != records-alone {
		b.Fatalf("purged %d records, want %d", n, records-alone)
	}
	b.ReportMetric(float64(n)/took.Seconds(), "purged/s-under-load")
	for _, p := range []string{"idle", "purging"} {
		l := latency[p]
		slices.Sort(l)
		if len(l) == 0 {
			b.Fatalf("no deliveries %s", p)
		}
		q := func(f float64) float64 { return float64(l[int(f*float64(len(l)-1))].Microseconds()) / 1e3 }
		b.ReportMetric(q(0.5), "delivery-p50-ms-"+p)
		b.ReportMetric(q(0.99), "delivery-p99-ms-"+p)
		b.ReportMetric(float64(len(l))/map[string]float64{"idle": 3, "purging": took.Seconds()}[p], "deliveries/s-"+p)
	}
}

// fill inserts records expired rows into table, 5,000 to a statement.
func fill(b *testing.B, e engine, db *sql.DB, table string, records int) {
	const batch = 5000
	now := time.Now().UnixMilli()
	for start := 0; start < records; start += batch {
		var q strings.Builder
		q.WriteString("INSERT INTO " + table + " (idem_key, state, fence, lease_expiry_ms, expires_at_ms, token) VALUES ")
		args := make([]any, 0, 6*batch)
		for i := start; i < min(records, start+batch); i++ {
			if i > start {
				q.WriteString(", ")
			}
			if e.name == "postgres" {
				n := len(args)
				fmt.Fprintf(&q, "($%d, $%d, $%d, $%d, $%d, $%d)", n+1, n+2, n+3, n+4, n+5, n+6)
			} else {
				q.WriteString("(?, ?, ?, ?, ?, ?)")
			}
			// A 17-digit message id; done an hour ago, expired since
			// (the row's size does not depend on its instants).
			args = append(args, []byte(fmt.Sprintf("%017d", 12_000_000_000_000_000+i)), 2, 1,
				now-2*3600_000, now-3600_000+int64(i%1000), store.NewToken())
		}
		if _, err := db.Exec(q.String(), args...); err != nil {
			b.Fatal(err)
		}
	}
}

// sizes returns the bytes the table's rows and its indexes take on disk, as
// the engine accounts them (PostgreSQL: pg_table_size and
// pg_indexes_size; MariaDB: InnoDB's data and index length, where the
// data is the primary key's clustered index; SQLite: dbstat pages).
func sizes(b *testing.B, e engine, db *sql.DB, table string) (data, index int64) {
	ctx := context.Background()
	var err error
	switch e.name {
	case "postgres":
		if _, err = db.ExecContext(ctx, "VACUUM ANALYZE "+table); err == nil {
			err = db.QueryRowContext(ctx, "SELECT pg_table_size($1), pg_indexes_size($1)", table).Scan(&data, &index)
		}
	case "mysql":
		if _, err = db.ExecContext(ctx, "ANALYZE TABLE "+table); err == nil {
			err = db.QueryRowContext(ctx, "SELECT data_length, index_length FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?", table).Scan(&data, &index)
		}
	case "sqlite":
		err = db.QueryRowContext(ctx, `SELECT
	COALESCE(SUM(CASE WHEN name = ? THEN pgsize END), 0),
	COALESCE(SUM(CASE WHEN name <> ? THEN pgsize END), 0)
FROM dbstat WHERE name = ? OR name IN (SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?)`, table, table, table, table).Scan(&data, &index)
	}
	if err != nil {
		b.Fatal(err)
	}
	return data, index
}
