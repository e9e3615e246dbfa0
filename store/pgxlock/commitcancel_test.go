package pgxlock_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// waitFor polls query on pool until it answers true.
func waitFor(t *testing.T, pool *pgxpool.Pool, query string, args ...any) {
	t.Helper()
	for {
		var yes bool
		if err := pool.QueryRow(t.Context(), query, args...).Scan(&yes); err != nil {
			t.Fatal(err)
		}
		if yes {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ctx cancelled while the server runs CompleteTx's COMMIT, held there by
// a deferred constraint trigger waiting on an advisory lock: pgx cuts the
// connection and sends a cancel request, which the trigger swallows,
// going on to wait on a second lock, so the commit outlives the client.
// CompleteTx settles it: its release waits for the commit's row lock,
// and it answers what the commit did: true when it landed; an error (not
// ErrCommitUnknown), no rows and the claim released, when it failed.
func TestCompleteTxCancelledDuringASlowCommitAnswersTheCommitsOutcome(t *testing.T) {
	pool := openPool(t, testsvc.Postgres(t))
	b, _ := newBackend(t, pool)
	s := newSink(t, pool)
	first := rand.Int64N(1 << 30)
	second := first + 1
	for _, q := range []string{
		fmt.Sprintf(`CREATE FUNCTION %s_slow() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	BEGIN
		PERFORM pg_advisory_xact_lock(%d);
	EXCEPTION WHEN query_canceled THEN
		PERFORM pg_advisory_xact_lock(%d);
	END;
	RETURN NULL;
END $$`, s.table, first, second),
		fmt.Sprintf(`CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON %s DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW EXECUTE FUNCTION %s_slow()`, s.table, s.table),
	} {
		if _, err := pool.Exec(t.Context(), q); err != nil {
			t.Fatal(err)
		}
	}
	waiting := `SELECT count(*) = 1 FROM pg_locks WHERE locktype = 'advisory' AND objid = $1 AND NOT granted`
	for _, lands := range []bool{true, false} {
		name := map[bool]string{true: "the commit lands", false: "the commit fails"}[lands]
		t.Run(name, func(t *testing.T) {
			holder, err := pool.Acquire(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			defer holder.Release()
			if _, err := holder.Exec(t.Context(), "SELECT pg_advisory_lock($1), pg_advisory_lock($2)", first, second); err != nil {
				t.Fatal(err)
			}
			defer holder.Exec(context.Background(), "SELECT pg_advisory_unlock_all()")
			c := won(t, b, name)
			ctx, cancel := context.WithCancel(t.Context())
			type answer struct {
				ok  bool
				err error
			}
			got := make(chan answer, 1)
			go func() {
				ok, err := b.CompleteTx(ctx, c, "", func(ctx context.Context, tx pgx.Tx) error { return s.write(ctx, tx, name) })
				got <- answer{ok, err}
			}()
			waitFor(t, pool, waiting, first)
			cancel()
			// pgx's cancel request reached the trigger, which waits again.
			waitFor(t, pool, waiting, second)
			// The settling release waits for the commit's row lock.
			waitFor(t, pool, `SELECT count(*) >= 1 FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted`)
			if lands {
				if _, err := holder.Exec(t.Context(), "SELECT pg_advisory_unlock_all()"); err != nil {
					t.Fatal(err)
				}
			} else if _, err := pool.Exec(t.Context(), "SELECT pg_cancel_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND objid = $1 AND NOT granted", second); err != nil {
				t.Fatal(err)
			}
			a := <-got
			rec, _, ierr := b.Inspect(t.Context(), name)
			n, cerr := s.count(t.Context(), name)
			if ierr != nil || cerr != nil {
				t.Fatal(ierr, cerr)
			}
			if lands {
				if !a.ok || a.err != nil || n != 1 || rec.State != store.Done {
					t.Errorf("CompleteTx = %v, %v; rows %d, record %+v; want true, nil, 1 row, Done", a.ok, a.err, n, rec)
				}
				return
			}
			if a.ok || a.err == nil || errors.Is(a.err, store.ErrCommitUnknown) || n != 0 || rec.State != store.Claimed || rec.Fence != c.Fence+1 {
				t.Errorf("CompleteTx = %v, %v; rows %d, record %+v; want false, an error that knows, no rows, the claim released", a.ok, a.err, n, rec)
			}
		})
	}
}
