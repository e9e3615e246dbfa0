package enginetest

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/internal/dialect"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// raceClaims sends n Claims on key at once and returns their results and
// errors.
func raceClaims(t *testing.T, b *sqllock.Backend, key string, n int, lease time.Duration) ([]store.Result, []error) {
	t.Helper()
	var wg sync.WaitGroup
	start := make(chan struct{})
	results := make([]store.Result, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			<-start
			results[i], errs[i] = b.Claim(t.Context(), key, lease)
		})
	}
	close(start)
	wg.Wait()
	return results, errs
}

// completedAndExpired claims key, completes it, and waits until the Done
// record's ttl has passed: the next Claims race to reclaim it. It returns
// the completed claim.
func completedAndExpired(t *testing.T, b *sqllock.Backend, key string) store.Claim {
	t.Helper()
	r, err := b.Claim(t.Context(), key, time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("%s: first claim: %v %v", key, r.Outcome, err)
	}
	if ok, err := b.Complete(t.Context(), r.Claim); !ok || err != nil {
		t.Fatalf("%s: complete: %v %v", key, ok, err)
	}
	time.Sleep(b.TTL() + 30*time.Millisecond)
	return r.Claim
}

// Issue 9, defect 1: on PostgreSQL, a Claim that lost the race to reclaim an
// expired Done key answered AlreadyDone (with an Until in the past) from its
// statement's snapshot, taken before the winner committed. Lock turned that
// into ErrDuplicate and the delivery was acked; had the winner's body failed,
// the message was gone. Exactly one racer may win; the others are held.
func TestRacingClaimsOnAnExpiredDoneKeyAdmitExactlyOne(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		const (
			ttl    = 100 * time.Millisecond
			racers = 16
			rounds = 40
		)
		_, b := e.fresh(t, nil, sqllock.WithTTL(ttl))
		bad := 0
		for round := range rounds {
			key := fmt.Sprint("expired-done-", round)
			done := completedAndExpired(t, b, key)
			before := time.Now()
			var won, held int
			var wrong []string
			results, errs := raceClaims(t, b, key, racers, time.Minute)
			for i, res := range results {
				switch {
				case errs[i] != nil:
					t.Fatalf("round %d: racer %d: %v", round, i, errs[i])
				case res.Outcome == store.Won:
					won++
					if res.Claim.Fence != done.Fence+1 {
						wrong = append(wrong, fmt.Sprintf("won with fence %d, want %d", res.Claim.Fence, done.Fence+1))
					}
				case res.Outcome == store.HeldByOther:
					held++
				default:
					wrong = append(wrong, fmt.Sprintf("%v until %v (%v before the race began)", res.Outcome, res.Until.Format(time.StampMilli), before.Sub(res.Until).Round(time.Millisecond)))
				}
			}
			if won != 1 || held != racers-1 || len(wrong) > 0 {
				bad++
				t.Errorf("round %d: %d won, %d held (want 1 and %d); %v", round, won, held, racers-1, wrong)
			}
		}
		if bad > 0 {
			t.Errorf("%d of %d rounds went wrong", bad, rounds)
		}
	})
}

// Issue 9: MySQL refused tables of 54 or more characters (the index name
// passed 64) though New allows 63, and PostgreSQL truncated the index name
// to 63 characters, where for a 63-character table it equals the table's
// own name: CREATE INDEX IF NOT EXISTS then skipped it silently. At the
// limit, every engine creates the table and its index on expires_at_ms,
// and two long names that differ only at the end get one index each.
func TestEnsureSchemaAtTheTableNameLimit(t *testing.T) {
	countIndexes := map[string]string{
		"postgres": `SELECT COUNT(*) FROM pg_indexes WHERE tablename = $1 AND indexdef LIKE '%(expires_at_ms)%'`,
		"mysql":    `SELECT COUNT(*) FROM information_schema.statistics WHERE table_schema = DATABASE() AND table_name = ? AND column_name = 'expires_at_ms'`,
		"sqlite":   `SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND tbl_name = ? AND sql LIKE '%(expires_at_ms)%'`,
	}
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db := e.open(t, e.dsn(t), nil)
		ctx := t.Context()
		stem := fmt.Sprintf("limit_%016x_", rand.Uint64())
		long := stem + strings.Repeat("x", 63-len(stem))
		names := []string{
			long[:52], long[:53], long[:54], long[:62],
			long[:62] + "a", long[:62] + "b", // differ only in the last character
		}
		if e.name == "postgres" {
			names = append(names, "public."+long[:61]+"zz")
		}
		for _, name := range names {
			b, err := sqllock.New(db, e.dialect, sqllock.WithTable(name))
			if err != nil {
				t.Fatalf("%d characters: %v", len(name), err)
			}
			if err := b.EnsureSchema(ctx); err != nil {
				t.Fatalf("%d characters: %v", len(name), err)
			}
			if err := b.EnsureSchema(ctx); err != nil {
				t.Fatalf("%d characters, again: %v", len(name), err)
			}
			if r, err := b.Claim(ctx, "k", time.Minute); err != nil || r.Outcome != store.Won {
				t.Fatalf("%d characters: claim: %v %v", len(name), r.Outcome, err)
			}
			table := name[strings.LastIndexByte(name, '.')+1:]
			var n int
			if err := db.QueryRowContext(ctx, countIndexes[e.name], table).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n != 1 {
				t.Errorf("table of %d characters has %d indexes on expires_at_ms, want 1", len(table), n)
			}
		}
	})
}

// A record purged after its expires-at instant starts again at fence 1. A
// holder from the key's earlier life (running past its lease and the ttl,
// which the port's defaults rule out but a paused process can still do)
// holds fence 1 too: its token keeps it from completing, releasing or
// extending the new claim.
func TestHolderFromBeforeAPurgeCannotTouchTheNewClaim(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		const ttl = 100 * time.Millisecond
		_, b := e.fresh(t, nil, sqllock.WithTTL(ttl))
		ctx := t.Context()
		old, err := b.Claim(ctx, "k", 50*time.Millisecond)
		if err != nil || old.Outcome != store.Won {
			t.Fatal(old.Outcome, err)
		}
		time.Sleep(50*time.Millisecond + ttl + 50*time.Millisecond)
		if n, err := b.PurgeExpired(ctx, 0); n != 1 || err != nil {
			t.Fatalf("PurgeExpired = %d, %v; want the lapsed record", n, err)
		}
		fresh, err := b.Claim(ctx, "k", time.Minute)
		if err != nil || fresh.Outcome != store.Won || fresh.Claim.Fence != old.Claim.Fence {
			t.Fatalf("claim after the purge: %v fence %d %v; want won with fence %d", fresh.Outcome, fresh.Claim.Fence, err, old.Claim.Fence)
		}
		if _, err := b.Extend(ctx, old.Claim, time.Hour); !errors.Is(err, store.ErrLost) {
			t.Errorf("the old holder's Extend: %v, want ErrLost", err)
		}
		if err := b.Release(ctx, old.Claim); err != nil {
			t.Fatal(err)
		}
		if ok, err := b.Complete(ctx, old.Claim); ok || err != nil {
			t.Errorf("the old holder's Complete: %v %v, want false", ok, err)
		}
		if r, err := b.Claim(ctx, "k", time.Minute); err != nil || r.Outcome != store.HeldByOther {
			t.Errorf("after the old holder's calls: %v %v, want held by other", r.Outcome, err)
		}
		if ok, err := b.Complete(ctx, fresh.Claim); !ok || err != nil {
			t.Errorf("the new holder's Complete: %v %v", ok, err)
		}
	})
}

// Every shape of table name New accepts runs as DDL and as statements:
// one part or two (SQLite's schema "main"), every length from 1 to 63, and
// a first character of each class (underscore, lower and upper case
// letter); the DDL depends on nothing else once the characters are plain.
// FuzzTableName (in sqllock) checks the rendering of arbitrary names
// without an engine; this runs each shape on SQLite.
func TestEnsureSchemaForEveryShapeOfTableName(t *testing.T) {
	db := sqliteEngine.open(t, sqliteEngine.dsn(t), nil)
	ctx := t.Context()
	const rest = "a1_Bz9"
	shapes := 0
	for _, schema := range []string{"", "main."} {
		for n := 1; n <= dialect.MaxIdent; n++ {
			for _, first := range "_kK" {
				table := string(first)
				for i := 1; i < n; i++ {
					table += string(rest[(i+n)%len(rest)])
				}
				b, err := sqllock.New(db, sqllock.SQLite, sqllock.WithTable(schema+table))
				if err != nil {
					t.Fatalf("New(WithTable(%q)): %v", schema+table, err)
				}
				if err := b.EnsureSchema(ctx); err != nil {
					t.Fatalf("EnsureSchema(%q): %v", schema+table, err)
				}
				if r, err := b.Claim(ctx, "k", time.Minute); err != nil || r.Outcome != store.Won {
					t.Fatalf("%q: claim: %v %v", schema+table, r.Outcome, err)
				}
				if err := b.Close(); err != nil {
					t.Fatal(err)
				}
				if _, err := db.ExecContext(ctx, "DROP TABLE "+dialect.SQLite().Quote(table)); err != nil {
					t.Fatalf("DROP TABLE %q: %v", table, err)
				}
				shapes++
			}
		}
	}
	t.Logf("%d shapes of table name", shapes)
}
