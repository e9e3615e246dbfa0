package enginetest

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/pgxlock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// serverCPU returns the CPU time, in ns, that every postgres process
// descending from this test binary has used (/proc/<pid>/schedstat: the
// server testsvc started, its backends included), and false when there is
// none (POSTGRES_DSN names a server of another process, or no /proc).
func serverCPU() (int64, bool) {
	parent := map[int]int{}
	comm := map[int]string{}
	dirs, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, d := range dirs {
		data, err := os.ReadFile(d)
		if err != nil {
			continue
		}
		s := string(data)
		open, closing := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || closing < open {
			continue
		}
		pid, _ := strconv.Atoi(strings.TrimSpace(s[:open]))
		fields := strings.Fields(s[closing+1:])
		if len(fields) < 2 {
			continue
		}
		ppid, _ := strconv.Atoi(fields[1])
		parent[pid], comm[pid] = ppid, s[open+1:closing]
	}
	self := os.Getpid()
	var total int64
	found := false
	for pid, c := range comm {
		if c != "postgres" {
			continue
		}
		mine := false
		for p, hops := parent[pid], 0; p > 1 && hops < 8; p, hops = parent[p], hops+1 {
			if p == self {
				mine = true
				break
			}
		}
		if !mine {
			continue
		}
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/schedstat", pid))
		if err != nil {
			continue
		}
		f := strings.Fields(string(data))
		if len(f) == 0 {
			continue
		}
		ns, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			continue
		}
		total += ns
		found = true
	}
	return total, found
}

// BenchmarkServerCPU runs PostgreSQL deliveries through Lock (impl=lock)
// beside two plain writes (impl=baseline-2-writes: INSERT ... ON CONFLICT
// DO NOTHING, then an UPDATE of that row marking it done, both prepared),
// both through database/sql, and the same two through pgx's own pool:
// Lock on pgxlock (impl=pgx-lock) and the two writes on the pool
// (impl=pgx-baseline-2-writes, pgx's statement cache preparing them), at
// 1 and 16 workers, and reports the CPU time each delivery costs, which
// moves far less with the machine's load than deliveries/s:
// server-cpu-us/delivery, every postgres process's CPU time (when testsvc
// started the server: POSTGRES_DSN unset), and cpu-ns/op, this process's
// (the client: Lock, the backend, database/sql and pgx).
func BenchmarkServerCPU(b *testing.B) {
	noop := func(context.Context) error { return nil }
	e := postgres
	dsn := e.dsn(b)
	for _, workers := range []int{1, 16} {
		for _, kind := range []string{"baseline-2-writes", "lock", "pgx-baseline-2-writes", "pgx-lock"} {
			b.Run(fmt.Sprintf("impl=%s/workers=%d", kind, workers), func(b *testing.B) {
				db := e.open(b, dsn, nil)
				ctx := context.Background()
				// Each side's tables go when it ends, so that the
				// autovacuum of the rows it wrote cannot land on (and
				// count in the server CPU of) the side after it.
				dropAtEnd := func(be *sqllock.Backend) *sqllock.Backend {
					b.Cleanup(func() {
						if _, err := db.Exec("DROP TABLE " + tableOf(be)); err != nil {
							b.Error(err)
						}
					})
					return be
				}
				be := dropAtEnd(e.backend(b, db))
				prefix := fmt.Sprint(time.Now().UnixNano(), ":")
				var run func(key string) error
				switch kind {
				case "lock":
					run = func(key string) error { return idempotency.Lock(ctx, be, prefix+key, noop) }
				case "pgx-lock":
					pb, err := pgxlock.New(openPgxPool(b, dsn), pgxlock.WithTable(tableOf(be)))
					if err != nil {
						b.Fatal(err)
					}
					run = func(key string) error { return idempotency.Lock(ctx, pb, prefix+key, noop) }
				case "pgx-baseline-2-writes":
					pool := openPgxPool(b, dsn)
					table := tableOf(dropAtEnd(e.backend(b, db)))
					run = func(key string) error {
						return twoWrites(key, prefix, func(q string, args ...any) error {
							_, err := pool.Exec(ctx, q, args...)
							return err
						}, "INSERT INTO "+table+baselineInsert, "UPDATE "+table+baselineUpdate)
					}
				default:
					plain := dropAtEnd(e.backend(b, db))
					ins, err := db.PrepareContext(ctx, "INSERT INTO "+tableOf(plain)+baselineInsert)
					if err != nil {
						b.Fatal(err)
					}
					upd, err := db.PrepareContext(ctx, "UPDATE "+tableOf(plain)+baselineUpdate)
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { ins.Close(); upd.Close() })
					stmts := map[string]*sql.Stmt{"ins": ins, "upd": upd}
					run = func(key string) error {
						return twoWrites(key, prefix, func(q string, args ...any) error {
							_, err := stmts[q].ExecContext(ctx, args...)
							return err
						}, "ins", "upd")
					}
				}
				// Open the workers' connections, and get past each one's
				// first executions of a statement (custom plans).
				for i := range 8 {
					bench.Deliveries(b, workers, func(key string) error { return run(fmt.Sprint("warm-up-", i, "-", key)) })
				}
				srv0, ok := serverCPU()
				report := bench.CPU(b)
				b.ResetTimer()
				bench.Deliveries(b, workers, run)
				b.StopTimer()
				report()
				if srv1, ok2 := serverCPU(); ok && ok2 {
					b.ReportMetric(float64(srv1-srv0)/1e3/float64(b.N), "server-cpu-us/delivery")
				}
			})
		}
	}
}

// The baseline's two writes, after "INSERT INTO <table>" and "UPDATE
// <table>".
const (
	baselineInsert = " (idem_key, state, fence, lease_expiry_ms, expires_at_ms, token) VALUES ($1, 1, 1, $2, $3, $4) ON CONFLICT DO NOTHING"
	baselineUpdate = " SET state = 2, expires_at_ms = $1 WHERE idem_key = $2"
)

// twoWrites is the baseline's delivery of key: exec runs ins (an insert
// of a claimed row that does nothing when the key is taken), then upd
// (marking the row done).
func twoWrites(key, prefix string, exec func(q string, args ...any) error, ins, upd string) error {
	k := []byte(prefix + key)
	now := time.Now().UnixMilli()
	lease := now + store.DefaultLease.Milliseconds()
	if err := exec(ins, k, lease, lease+store.DefaultTTL.Milliseconds(), store.NewToken()); err != nil {
		return err
	}
	return exec(upd, now+store.DefaultTTL.Milliseconds(), k)
}

// openPgxPool opens a pgx pool on dsn, closed when b ends, of as many
// connections as the database/sql pools of engine.open (64), so that at 16
// workers neither side waits for a connection (pgxpool's default is 4 on
// two cores).
func openPgxPool(b testing.TB, dsn string) *pgxpool.Pool {
	b.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = 64
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool
}
