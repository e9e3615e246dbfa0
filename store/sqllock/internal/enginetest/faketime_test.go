package enginetest

import (
	"database/sql"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
)

// A server under libfaketime (the contract suite's server clock that
// jumps) reads the clock the test moves, ahead and behind, while it runs,
// and the next test to take it finds it back at this machine's time.
func TestServersOnAFakeClockJump(t *testing.T) {
	for _, c := range []struct {
		name, driver, query string
		start               func(t testing.TB) (string, *testsvc.FakeClock)
	}{
		{"postgres", "pgx", "SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8", testsvc.PostgresOnFakeClock},
		{"mariadb", "mysql", "SELECT CAST(UNIX_TIMESTAMP(SYSDATE(6)) AS DOUBLE)", testsvc.MariaDBOnFakeClock},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, turn := range []string{"first", "second"} {
				t.Run(turn, func(t *testing.T) {
					dsn, clock := c.start(t)
					db, err := sql.Open(c.driver, dsn)
					if err != nil {
						t.Fatal(err)
					}
					defer db.Close()
					for _, d := range []time.Duration{0, 2 * time.Hour, -4 * time.Hour} {
						clock.Jump(d)
						var s float64
						if err := db.QueryRow(c.query).Scan(&s); err != nil {
							t.Fatal(err)
						}
						got, want := time.Unix(0, int64(s*1e9)), clock.Now()
						if diff := got.Sub(want); diff < -time.Second || diff > time.Second {
							t.Fatalf("after a jump by %v: the server's clock reads %v, want about %v (off by %v)", d, got, want, diff)
						}
					}
				})
			}
		})
	}
}
