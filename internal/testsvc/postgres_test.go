package testsvc

import (
	"net/url"
	"testing"
)

func postgresAddr(t *testing.T, dsn string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil || u.Host == "" {
		t.Fatalf("DSN %q: no host (%v)", dsn, err)
	}
	return u.Host
}

func TestPostgresIsSharedAndAnswers(t *testing.T) {
	t.Parallel()
	a, b := Postgres(t), Postgres(t)
	if a != b {
		t.Fatalf("Postgres returned %q, then %q", a, b)
	}
	if err := PostgresReady(postgresAddr(t, a)); err != nil {
		t.Fatal(err)
	}
}

func TestStartPostgresKillAndRestart(t *testing.T) {
	t.Parallel()
	p, dsn := StartPostgres(t)
	if got := postgresAddr(t, dsn); got != p.Addr {
		t.Fatalf("DSN %q does not point at %s", dsn, p.Addr)
	}
	restart(t, p, PostgresReady)
}
