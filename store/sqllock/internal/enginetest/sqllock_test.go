package enginetest

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"log"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

func TestMain(m *testing.M) {
	// The tests kill connections and servers on purpose; the driver's own
	// log lines about it are noise.
	mysql.SetLogger(log.New(io.Discard, "", 0))
	if testsvc.IsRaceChild() {
		os.Exit(raceChild())
	}
	code := m.Run()
	testsvc.StopAll()
	os.Exit(code)
}

// TestContract runs the storetest suite on every engine. The networked
// engines get a DropProxy of their own per case as the Harness's Faults
// (arming it loses the next reply on any of the case's connections), so
// the suite checks retry safety after lost replies and cut connections.
func TestContract(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		storetest.Run(t, contractHarness(t, e, false))
	})
}

// TestOps runs the storetest suite of the operations interfaces
// (store.Operator) on every engine, with the harness of TestContract;
// SQLite, which has no connection to cut, loses replies in its driver
// (sqliteFaults).
func TestOps(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		storetest.RunOps(t, contractHarness(t, e, true))
	})
}

// contractHarness returns the contract suites' harness factory for e, on
// a database shared by the cases, each on a table of its own. With
// sqliteFaulty, SQLite's cases get sqliteFaults as their Faults.
func contractHarness(t *testing.T, e engine, sqliteFaulty bool) func(t *testing.T) storetest.Harness {
	dsn := e.dsn(t)
	shared := e.open(t, dsn, nil)
	return func(t *testing.T) storetest.Harness {
		const ttl = 2 * time.Second
		h := storetest.Harness{TTL: ttl, Step: 200 * time.Millisecond}
		db := shared
		if host := serverAddr(e, dsn); host != "" {
			proxy := testsvc.NewDropProxy(t, host)
			db = e.open(t, strings.Replace(dsn, host, proxy.Addr(), 1), nil)
			h.Faults = proxy
		} else if sqliteFaulty {
			c := &counter{}
			db = e.open(t, dsn, c)
			h.Faults = sqliteFaults{c}
		}
		b := e.backend(t, db, sqllock.WithTTL(ttl))
		h.Backend = b
		// On the same table: a purge by either backend sees the
		// other's records.
		h.WithTTL = func(ttl time.Duration) store.Backend {
			o, err := sqllock.New(db, e.dialect, sqllock.WithTable(tableOf(b)), sqllock.WithTTL(ttl))
			if err != nil {
				t.Fatal(err)
			}
			return o
		}
		h.ServerClock = jumpHarness(e)
		return h
	}
}

// jumpHarness is the contract suite's backend on a server whose wall clock
// the suite jumps (storetest.JumpHarness): a server of the engine started
// under libfaketime, one case at a time. It is nil for SQLite, which reads
// the clock of the process it runs in, the client's: there is no server
// clock to jump apart from it.
func jumpHarness(e engine) func(t *testing.T) storetest.JumpHarness {
	var start func(t testing.TB) (string, *testsvc.FakeClock)
	switch e.name {
	case "postgres":
		start = testsvc.PostgresOnFakeClock
	case "mysql":
		start = func(t testing.TB) (string, *testsvc.FakeClock) {
			base, clock := testsvc.MariaDBOnFakeClock(t)
			return createDatabase(t, base, "idem_test"), clock
		}
	default:
		return nil
	}
	return func(t *testing.T) storetest.JumpHarness {
		const ttl = 2 * time.Second
		dsn, clock := start(t)
		db := e.open(t, dsn, nil)
		return storetest.JumpHarness{
			Harness: storetest.Harness{Backend: e.backend(t, db, sqllock.WithTTL(ttl)), TTL: ttl, Step: 200 * time.Millisecond, Now: clock.Now},
			Jump:    clock.Jump,
		}
	}
}

// serverAddr is the host:port in a networked engine's DSN, or "" for
// SQLite.
func serverAddr(e engine, dsn string) string {
	switch e.name {
	case "postgres":
		return dsn[strings.Index(dsn, "@")+1 : strings.LastIndex(dsn, "/")]
	case "mysql":
		return dsn[strings.Index(dsn, "tcp(")+4 : strings.Index(dsn, ")")]
	}
	return ""
}

func TestHostileKeysAreStoredVerbatimNeverExecuted(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil)
		ctx := t.Context()
		keys := []string{
			"'; DROP TABLE " + tableOf(b) + "; --",
			`" OR 1=1 --`, "`x`", "\\'\\\"", "ключ 鍵 🔑", "\xff\xfe\x01", strings.Repeat("k", store.MaxKeyLen),
		}
		for _, k := range keys {
			r, err := b.Claim(ctx, k, time.Minute)
			if err != nil || r.Outcome != store.Won || r.Claim.Fence != 1 {
				t.Fatalf("%.20q: %v fence %d %v", k, r.Outcome, r.Claim.Fence, err)
			}
		}
		var n int
		if err := db.QueryRow("SELECT COUNT(*) FROM " + tableOf(b)).Scan(&n); err != nil || n != len(keys) {
			t.Fatalf("table holds %d rows (%v), want %d", n, err, len(keys))
		}
		var stored []byte
		if err := db.QueryRow("SELECT idem_key FROM " + tableOf(b) + " WHERE fence = 1 ORDER BY LENGTH(idem_key) DESC LIMIT 1").Scan(&stored); err != nil || string(stored) != keys[len(keys)-1] {
			t.Fatalf("the 1 KiB key came back as %d bytes (%v)", len(stored), err)
		}
	})
}

// tableOf digs the table name out of the schema.
func tableOf(b *sqllock.Backend) string {
	s := b.Schema()
	s = s[strings.Index(s, "EXISTS ")+len("EXISTS "):]
	return strings.Trim(s[:strings.IndexAny(s, " \n")], "\"`")
}

func TestEnsureSchemaFromManyInstancesAtOnce(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		dsn := e.dsn(t)
		table := fmt.Sprintf("concurrent_%d", time.Now().UnixNano())
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for range 8 {
			wg.Go(func() {
				db := e.open(t, dsn, nil)
				b, err := sqllock.New(db, e.dialect, sqllock.WithTable(table))
				if err == nil {
					err = b.EnsureSchema(context.Background())
				}
				errs <- err
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("EnsureSchema: %v", err)
			}
		}
	})
}

func TestRacingConnectionsAdmitExactlyOne(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		_, b := e.fresh(t, nil)
		for round := range 5 {
			key := fmt.Sprint("race-", round)
			const n = 32
			var won, held atomic.Int32
			var wg sync.WaitGroup
			start := make(chan struct{})
			for range n {
				wg.Go(func() {
					<-start
					r, err := b.Claim(context.Background(), key, time.Minute)
					switch {
					case err != nil:
						t.Errorf("claim: %v", err)
					case r.Outcome == store.Won:
						won.Add(1)
					case r.Outcome == store.HeldByOther:
						held.Add(1)
					}
				})
			}
			close(start)
			wg.Wait()
			if won.Load() != 1 || held.Load() != n-1 {
				t.Fatalf("round %d: %d won, %d held; want 1 and %d", round, won.Load(), held.Load(), n-1)
			}
		}
	})
}

// Two processes with eight goroutines each race one key: one wins.
func TestTwoProcessesRaceOneKey(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		dsn := e.dsn(t)
		b := e.backend(t, e.open(t, dsn, nil))
		won, held := testsvc.RaceProcesses(t, "HELPER_ENGINE="+e.name, "HELPER_DSN="+dsn, "HELPER_TABLE="+tableOf(b))
		if won != 1 || held != 15 {
			t.Fatalf("won %d, held %d across two processes; want 1 and 15", won, held)
		}
	})
}

// raceChild builds the backend a race child claims on.
func raceChild() int {
	var e engine
	for _, x := range engines {
		if x.name == os.Getenv("HELPER_ENGINE") {
			e = x
		}
	}
	db := sql.OpenDB(&countingConnector{dsn: os.Getenv("HELPER_DSN"), drv: e.drv, c: &counter{}})
	defer db.Close()
	b, err := sqllock.New(db, e.dialect, sqllock.WithTable(os.Getenv("HELPER_TABLE")))
	if err != nil {
		fmt.Println(err)
		return 1
	}
	// Open the connections before the start line, so the race is the claims'.
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() { db.Ping() })
	}
	wg.Wait()
	return testsvc.RaceChild(b)
}

func TestRoundTripsPerDelivery(t *testing.T) {
	want := map[string][2]int{ // fresh delivery, duplicate
		// PostgreSQL's Claim tries a plain insert first, and runs its
		// full claim only when the key is taken.
		"postgres": {2, 2},
		"sqlite":   {2, 2},
		"mysql":    {2, 2},
	}
	eachEngine(t, engines, func(t *testing.T, e engine) {
		c := &counter{}
		_, b := e.fresh(t, c)
		ctx := t.Context()
		noop := func(context.Context) error { return nil }
		c.n.Store(0)
		for i := range 10 {
			if err := idempotency.Lock(ctx, b, fmt.Sprint("d", i), noop); err != nil {
				t.Fatal(err)
			}
		}
		if got := c.n.Load(); got != int64(10*want[e.name][0]) {
			t.Errorf("%d statements for 10 fresh deliveries, want %d each", got, want[e.name][0])
		}
		c.n.Store(0)
		idempotency.Lock(ctx, b, "d0", noop)
		if got := c.n.Load(); got != int64(want[e.name][1]) {
			t.Errorf("a duplicate took %d statements, want %d", got, want[e.name][1])
		}
	})
}

// A connection cut after the server ran the claim but before the client
// read the answer: the retry re-affirms the claim (same token, same fence),
// and the row is the one claim, whole.
func TestConnectionKilledMidClaim(t *testing.T) {
	eachEngine(t, networked, func(t *testing.T, e engine) { // the networked engines
		dsn := e.dsn(t)
		host := serverAddr(e, dsn)
		proxy := testsvc.NewDropProxy(t, host)
		pdsn := strings.Replace(dsn, host, proxy.Addr(), 1)
		db := e.open(t, pdsn, nil)
		db.SetMaxOpenConns(1)
		b := e.backend(t, db)
		ctx := t.Context()
		if _, err := b.Claim(ctx, "warm-up", time.Minute); err != nil {
			t.Fatal(err)
		}
		proxy.Armed.Store(true)
		r, err := b.Claim(ctx, "k", time.Minute)
		if proxy.Dropped.Load() != 1 {
			t.Fatalf("dropped %d replies, want 1", proxy.Dropped.Load())
		}
		if err != nil || r.Outcome != store.Won || r.Claim.Fence != 1 {
			t.Fatalf("claim whose reply was lost: %v fence %d %v; want won, fence 1", r.Outcome, r.Claim.Fence, err)
		}
		var fence int64
		var token string
		if err := db.QueryRow("SELECT fence, token FROM "+tableOf(b)+" WHERE idem_key = "+map[bool]string{true: "$1", false: "?"}[e.name == "postgres"], []byte("k")).Scan(&fence, &token); err != nil {
			t.Fatal(err)
		}
		if fence != 1 || token != r.Claim.Token {
			t.Fatalf("row: fence %d token %q; want fence 1 and the claim's token %q", fence, token, r.Claim.Token)
		}
		if other, _ := b.Claim(ctx, "k", time.Minute); other.Outcome != store.HeldByOther {
			t.Fatalf("another claim: %v", other.Outcome)
		}
	})
}

func TestDatabaseRestartedMidTest(t *testing.T) {
	type server struct {
		proc  *testsvc.Process
		dsn   string
		ready func(string) error
		eng   engine
	}
	servers := map[string]func(t *testing.T) server{
		"postgres": func(t *testing.T) server {
			p, dsn := testsvc.StartPostgres(t)
			return server{p, dsn, testsvc.PostgresReady, postgres}
		},
		"mysql": func(t *testing.T) server {
			p, dsn := testsvc.StartMariaDB(t)
			return server{p, createDatabase(t, dsn, "idem_restart"), testsvc.MySQLReady, mariadb}
		},
	}
	for name, start := range servers {
		t.Run(name, func(t *testing.T) {
			s := start(t)
			db := s.eng.open(t, s.dsn, nil)
			b := s.eng.backend(t, db)
			ctx := t.Context()
			r, err := b.Claim(ctx, "k", time.Hour)
			if err != nil || r.Outcome != store.Won {
				t.Fatal(r, err)
			}
			s.proc.Kill()
			down, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			if _, err := b.Claim(down, "k2", time.Minute); err == nil {
				t.Fatal("claim succeeded with the database down")
			}
			if _, err := b.Complete(down, r.Claim); err == nil {
				t.Fatal("complete succeeded with the database down")
			}
			if err := s.proc.Restart(s.ready); err != nil {
				t.Fatal(err)
			}
			// Committed claims survive the restart; the pool reconnects.
			deadline := time.Now().Add(20 * time.Second)
			for {
				other, err := b.Claim(ctx, "k", time.Minute)
				if err == nil {
					if other.Outcome != store.HeldByOther {
						t.Fatalf("after restart: %v, want held by other", other.Outcome)
					}
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("no recovery after restart: %v", err)
				}
				time.Sleep(100 * time.Millisecond)
			}
			if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
				t.Fatalf("complete after restart: %v %v", ok, err)
			}
		})
	}
}

func TestPurgeDeletesInBatchesByTheDatabaseClock(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		_, b := e.fresh(t, nil, sqllock.WithTTL(50*time.Millisecond))
		ctx := t.Context()
		for i := range 25 {
			r, _ := b.Claim(ctx, fmt.Sprint("old-", i), time.Millisecond)
			b.Complete(ctx, r.Claim)
		}
		time.Sleep(150 * time.Millisecond)
		live, _ := b.Claim(ctx, "live", time.Hour)
		if n, err := b.PurgeExpired(ctx, 10); n != 10 || err != nil {
			t.Fatalf("PurgeExpired(10) = %d, %v", n, err)
		}
		if n, err := b.PurgeExpired(ctx, 0); n != 15 || err != nil {
			t.Fatalf("PurgeExpired(0) = %d, %v; want the other 15", n, err)
		}
		if other, _ := b.Claim(ctx, "live", time.Minute); other.Outcome != store.HeldByOther {
			t.Fatalf("the live claim was purged: %v", other.Outcome)
		}
		_ = live
	})
}
