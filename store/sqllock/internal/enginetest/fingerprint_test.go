package enginetest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

var _ store.Fingerprinter = (*sqllock.Backend)(nil)

// expireNow moves the record of key past its expires-at instant (and its
// lease), as the ttl ending would, without waiting for it.
func expireNow(t *testing.T, db *sql.DB, e engine, b *sqllock.Backend, key string) {
	t.Helper()
	q := "UPDATE " + tableOf(b) + " SET expires_at_ms = 0, lease_expiry_ms = 0 WHERE idem_key = ?"
	if e.name == "postgres" {
		q = strings.Replace(q, "?", "$1", 1)
	}
	if _, err := db.ExecContext(t.Context(), q, []byte(key)); err != nil {
		t.Fatal(err)
	}
}

// A fingerprint is kept in the done record byte for byte (colons,
// newlines and multi-byte characters, up to MaxFingerprintLen), reported
// by every Claim that finds the key done, left alone by a second Complete
// of the same claim, and gone once the key is reclaimed; an empty one is
// none.
func TestFingerprintIsKeptReportedAndClearedByAReclaim(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil)
		ctx := t.Context()
		fp := "sha256:a:b\nc,é🔑"
		fp += strings.Repeat("x", store.MaxFingerprintLen-len(fp))

		r, err := b.Claim(ctx, "k", time.Minute)
		if err != nil || r.Outcome != store.Won || r.Fingerprint != "" {
			t.Fatal(r.Outcome, r.Fingerprint, err)
		}
		if ok, err := b.CompleteFingerprint(ctx, r.Claim, fp); !ok || err != nil {
			t.Fatalf("complete: %v %v", ok, err)
		}
		for range 2 {
			got, err := b.Claim(ctx, "k", time.Minute)
			if err != nil || got.Outcome != store.AlreadyDone || got.Fingerprint != fp {
				t.Fatalf("claim of the done key: %v fingerprint %q %v; want already done with %q", got.Outcome, got.Fingerprint, err, fp)
			}
		}
		// Completing again (a retry, or a call with another fingerprint)
		// changes nothing.
		if ok, err := b.CompleteFingerprint(ctx, r.Claim, "other"); !ok || err != nil {
			t.Fatalf("second complete: %v %v", ok, err)
		}
		if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
			t.Fatalf("third complete: %v %v", ok, err)
		}
		if got, _ := b.Claim(ctx, "k", time.Minute); got.Fingerprint != fp {
			t.Fatalf("after completing again: fingerprint %q, want %q", got.Fingerprint, fp)
		}

		// The ttl ends: the reclaim starts without one, and a plain
		// Complete stores none.
		expireNow(t, db, e, b, "k")
		r, err = b.Claim(ctx, "k", time.Minute)
		if err != nil || r.Outcome != store.Won || r.Claim.Fence != 2 || r.Fingerprint != "" {
			t.Fatalf("reclaim: %v fence %d fingerprint %q %v", r.Outcome, r.Claim.Fence, r.Fingerprint, err)
		}
		if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
			t.Fatal(ok, err)
		}
		if got, _ := b.Claim(ctx, "k", time.Minute); got.Outcome != store.AlreadyDone || got.Fingerprint != "" {
			t.Fatalf("done without a fingerprint: %v %q", got.Outcome, got.Fingerprint)
		}
		// A second reclaim, completed with a fingerprint again.
		expireNow(t, db, e, b, "k")
		r, _ = b.Claim(ctx, "k", time.Minute)
		if ok, err := b.CompleteFingerprint(ctx, r.Claim, "fp-3"); !ok || err != nil {
			t.Fatal(ok, err)
		}
		if got, _ := b.Claim(ctx, "k", time.Minute); got.Fingerprint != "fp-3" {
			t.Fatalf("third life: fingerprint %q, want fp-3", got.Fingerprint)
		}
		// An empty fingerprint is none.
		r, _ = b.Claim(ctx, "e", time.Minute)
		if ok, err := b.CompleteFingerprint(ctx, r.Claim, ""); !ok || err != nil {
			t.Fatal(ok, err)
		}
		if got, _ := b.Claim(ctx, "e", time.Minute); got.Outcome != store.AlreadyDone || got.Fingerprint != "" {
			t.Fatalf("empty fingerprint: %v %q", got.Outcome, got.Fingerprint)
		}
		var stored sql.NullString
		if err := db.QueryRowContext(ctx, "SELECT fingerprint FROM "+tableOf(b)+" WHERE fence = 1 AND state = 2").Scan(&stored); err != nil || stored.Valid {
			t.Fatalf("the record completed with an empty fingerprint holds %v (%v), want NULL", stored, err)
		}
	})
}

// A fingerprint or key the port refuses is refused before any I/O.
func TestCompleteFingerprintValidatesBeforeAnyIO(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		c := &counter{}
		_, b := e.fresh(t, c)
		c.n.Store(0)
		c.prepares.Store(0)
		claim := store.Claim{Key: "k", Fence: 1, Token: store.NewToken()}
		for _, fp := range []string{strings.Repeat("x", store.MaxFingerprintLen+1), "a\x00b", "\xff"} {
			if ok, err := b.CompleteFingerprint(t.Context(), claim, fp); ok || !errors.Is(err, store.ErrInvalidFingerprint) {
				t.Errorf("fingerprint %q: %v %v, want ErrInvalidFingerprint", fp, ok, err)
			}
		}
		if _, err := b.CompleteFingerprint(t.Context(), store.Claim{Fence: 1}, "fp"); !errors.Is(err, store.ErrInvalidKey) {
			t.Errorf("empty key: %v, want ErrInvalidKey", err)
		}
		if n, p := c.n.Load(), c.prepares.Load(); n != 0 || p != 0 {
			t.Fatalf("%d statements and %d prepares for refused arguments, want none", n, p)
		}
	})
}

// A fingerprint stored at one fence is not reported for a completion at a
// later fence that stored none, even when that completion came from an
// earlier version of this package, which knows no fingerprints and leaves
// the column alone (here: its reclaim and complete, as plain SQL).
func TestAFingerprintOfAnEarlierFenceIsNotReported(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil)
		ctx := t.Context()
		r, _ := b.Claim(ctx, "k", time.Minute)
		if ok, err := b.CompleteFingerprint(ctx, r.Claim, "fp-1"); !ok || err != nil {
			t.Fatal(ok, err)
		}
		q := "UPDATE " + tableOf(b) + " SET state = 2, fence = fence + 1, token = 'old-version' WHERE idem_key = ?"
		if e.name == "postgres" {
			q = strings.Replace(q, "?", "$1", 1)
		}
		if _, err := db.ExecContext(ctx, q, []byte("k")); err != nil {
			t.Fatal(err)
		}
		got, err := b.Claim(ctx, "k", time.Minute)
		if err != nil || got.Outcome != store.AlreadyDone || got.Fingerprint != "" {
			t.Fatalf("claim: %v fingerprint %q %v; want already done without one", got.Outcome, got.Fingerprint, err)
		}
	})
}

// The table as the previous version of this package created it, before
// the fingerprint column.
var previousSchema = map[string][]string{
	"postgres": {`CREATE TABLE {T} (
	idem_key        BYTEA PRIMARY KEY,
	state           SMALLINT NOT NULL,
	fence           BIGINT NOT NULL,
	lease_expiry_ms BIGINT NOT NULL,
	expires_at_ms   BIGINT NOT NULL,
	token           TEXT NOT NULL
)`, `CREATE INDEX {T}_expires_at ON {T} (expires_at_ms)`},
	"mysql": {`CREATE TABLE {T} (
	idem_key        VARBINARY(1024) NOT NULL PRIMARY KEY,
	state           TINYINT NOT NULL,
	fence           BIGINT NOT NULL,
	lease_expiry_ms BIGINT NOT NULL,
	expires_at_ms   BIGINT NOT NULL,
	token           VARCHAR(64) NOT NULL,
	INDEX {T}_expires_at (expires_at_ms)
) ENGINE=InnoDB`},
	"sqlite": {`CREATE TABLE {T} (
	idem_key        BLOB PRIMARY KEY,
	state           INTEGER NOT NULL,
	fence           INTEGER NOT NULL,
	lease_expiry_ms INTEGER NOT NULL,
	expires_at_ms   INTEGER NOT NULL,
	token           TEXT NOT NULL
)`, `CREATE INDEX {T}_expires_at ON {T} (expires_at_ms)`},
}

// A table created by the previous version, with live rows in it: until
// EnsureSchema runs, the verbs fail saying what to do (and run nothing);
// EnsureSchema, from several instances at once, adds the column; the old
// rows keep working (a done key is a duplicate without a fingerprint, a
// claimed key completes with its fence and token, an expired one is
// reclaimed) and new completions keep fingerprints.
func TestEnsureSchemaUpgradesATableOfThePreviousVersion(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		dsn := e.dsn(t)
		db := e.open(t, dsn, nil)
		ctx := t.Context()
		table := fmt.Sprintf("v1_%d", time.Now().UnixNano())
		for _, q := range previousSchema[e.name] {
			if _, err := db.ExecContext(ctx, strings.ReplaceAll(q, "{T}", table)); err != nil {
				t.Fatal(err)
			}
		}
		now := time.Now().UnixMilli()
		hour := time.Hour.Milliseconds()
		ins := "INSERT INTO " + table + " (idem_key, state, fence, lease_expiry_ms, expires_at_ms, token) VALUES (?, ?, ?, ?, ?, ?)"
		if e.name == "postgres" {
			ins = "INSERT INTO " + table + " (idem_key, state, fence, lease_expiry_ms, expires_at_ms, token) VALUES ($1, $2, $3, $4, $5, $6)"
		}
		rows := []struct {
			key                      string
			state, fence, lease, exp int64
			token                    string
		}{
			{"done", 2, 3, now - hour, now + hour, "t-done"},
			{"held", 1, 1, now + hour, now + 2*hour, "t-held"},
			{"old", 2, 5, now - 3*hour, now - hour, "t-old"},
		}
		for _, r := range rows {
			if _, err := db.ExecContext(ctx, ins, []byte(r.key), r.state, r.fence, r.lease, r.exp, r.token); err != nil {
				t.Fatal(err)
			}
		}

		b, err := sqllock.New(db, e.dialect, sqllock.WithTable(table))
		if err != nil {
			t.Fatal(err)
		}
		held := store.Claim{Key: "held", Fence: 1, Token: "t-held"}
		for name, call := range map[string]func() error{
			"claim":    func() error { _, err := b.Claim(ctx, "fresh", time.Minute); return err },
			"complete": func() error { _, err := b.CompleteFingerprint(ctx, held, "fp"); return err },
		} {
			err := call()
			if err == nil || !strings.Contains(err.Error(), "EnsureSchema") || !strings.Contains(err.Error(), b.UpgradeSchema()) {
				t.Fatalf("%s on the previous version's table: %v; want an error that says to run EnsureSchema", name, err)
			}
		}
		var n int
		if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table).Scan(&n); err != nil || n != len(rows) {
			t.Fatalf("%d rows (%v), want the %d old ones only", n, err, len(rows))
		}

		var wg sync.WaitGroup
		errs := make(chan error, 4)
		for range 4 {
			wg.Go(func() {
				other, err := sqllock.New(e.open(t, dsn, nil), e.dialect, sqllock.WithTable(table))
				if err == nil {
					err = other.EnsureSchema(ctx)
				}
				errs <- err
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("EnsureSchema on the previous version's table: %v", err)
			}
		}
		if err := b.EnsureSchema(ctx); err != nil {
			t.Fatalf("EnsureSchema once more: %v", err)
		}

		if r, err := b.Claim(ctx, "done", time.Minute); err != nil || r.Outcome != store.AlreadyDone || r.Fingerprint != "" {
			t.Fatalf("the old done row: %v %q %v; want already done without a fingerprint", r.Outcome, r.Fingerprint, err)
		}
		if r, err := b.Claim(ctx, "held", time.Minute); err != nil || r.Outcome != store.HeldByOther {
			t.Fatalf("the old claimed row: %v %v; want held by other", r.Outcome, err)
		}
		if ok, err := b.Complete(ctx, held); !ok || err != nil {
			t.Fatalf("completing the old claim: %v %v", ok, err)
		}
		if r, err := b.Claim(ctx, "held", time.Minute); err != nil || r.Outcome != store.AlreadyDone || r.Fingerprint != "" {
			t.Fatalf("the old claim, completed: %v %q %v", r.Outcome, r.Fingerprint, err)
		}
		r, err := b.Claim(ctx, "old", time.Minute)
		if err != nil || r.Outcome != store.Won || r.Claim.Fence != 6 {
			t.Fatalf("the old expired row: %v fence %d %v; want won with fence 6", r.Outcome, r.Claim.Fence, err)
		}
		if ok, err := b.CompleteFingerprint(ctx, r.Claim, "fp-new"); !ok || err != nil {
			t.Fatal(ok, err)
		}
		if r, err := b.Claim(ctx, "old", time.Minute); err != nil || r.Fingerprint != "fp-new" {
			t.Fatalf("after the upgrade: %v %q %v; want the fingerprint kept", r.Outcome, r.Fingerprint, err)
		}
	})
}

// A CompleteFingerprint whose reply was lost is resent and finds its own
// completion: true, and the fingerprint it stored is reported.
func TestCompleteFingerprintResentFindsItsOwnCompletion(t *testing.T) {
	eachEngine(t, networked, func(t *testing.T, e engine) {
		dsn := e.dsn(t)
		host := serverAddr(e, dsn)
		proxy := testsvc.NewDropProxy(t, host)
		db := e.open(t, strings.Replace(dsn, host, proxy.Addr(), 1), nil)
		db.SetMaxOpenConns(1)
		b := e.backend(t, db, sqllock.WithRetries(3))
		other, err := sqllock.New(e.open(t, dsn, nil), e.dialect, sqllock.WithTable(tableOf(b)))
		if err != nil {
			t.Fatal(err)
		}
		ctx := t.Context()
		// Prepare the statements on the one connection, so that the lost
		// reply is the update's.
		warm, _ := b.Claim(ctx, "warm-up", time.Minute)
		if ok, err := b.CompleteFingerprint(ctx, warm.Claim, "w"); !ok || err != nil {
			t.Fatal(ok, err)
		}
		mine, err := b.Claim(ctx, "k", time.Minute)
		if err != nil || mine.Outcome != store.Won {
			t.Fatal(mine.Outcome, err)
		}
		proxy.LoseNextReply()
		ok, err := b.CompleteFingerprint(ctx, mine.Claim, "fp-1")
		if proxy.Dropped.Load() != 1 {
			t.Fatalf("dropped %d replies, want 1", proxy.Dropped.Load())
		}
		if !ok || err != nil {
			t.Fatalf("resent complete: %v %v; want true", ok, err)
		}
		if got, err := other.Claim(ctx, "k", time.Minute); err != nil || got.Outcome != store.AlreadyDone || got.Fingerprint != "fp-1" {
			t.Fatalf("after: %v fingerprint %q %v, want already done with fp-1", got.Outcome, got.Fingerprint, err)
		}
	})
}

// A CompleteFingerprint that landed and lost its reply, resent after its
// done record was purged and another caller created the key afresh (at
// fence 1 again), marks nothing done and stores no fingerprint on the
// newcomer's record (the token tells the two claims apart), and returns an
// error: its work did complete, so false ("fenced out") would be wrong.
// (The contract suite's history check found the false answer on
// PostgreSQL, for a record reclaimed after its ttl rather than purged.)
func TestCompleteFingerprintResentAfterTheKeyWasRecreatedLeavesTheNewcomerAlone(t *testing.T) {
	eachEngine(t, networked, func(t *testing.T, e engine) {
		dsn := e.dsn(t)
		host := serverAddr(e, dsn)
		proxy := testsvc.NewDropProxy(t, host)
		c := &counter{}
		db := e.open(t, strings.Replace(dsn, host, proxy.Addr(), 1), c)
		db.SetMaxOpenConns(1)
		b := e.backend(t, db, sqllock.WithRetries(3))
		direct := e.open(t, dsn, nil)
		other, err := sqllock.New(direct, e.dialect, sqllock.WithTable(tableOf(b)))
		if err != nil {
			t.Fatal(err)
		}
		ctx := t.Context()
		warm, _ := b.Claim(ctx, "warm-up", time.Minute)
		if ok, err := b.CompleteFingerprint(ctx, warm.Claim, "w"); !ok || err != nil {
			t.Fatal(ok, err)
		}
		mine, err := b.Claim(ctx, "k", time.Minute)
		if err != nil || mine.Outcome != store.Won || mine.Claim.Fence != 1 {
			t.Fatal(mine.Outcome, mine.Claim.Fence, err)
		}

		entered, release := make(chan struct{}), make(chan struct{})
		var once sync.Once
		hold := func(context.Context) error {
			once.Do(func() {
				close(entered)
				<-release
			})
			return nil
		}
		c.onConnect.Store(&hold)
		type answer struct {
			ok  bool
			err error
		}
		got := make(chan answer, 1)
		proxy.LoseNextReply()
		go func() {
			ok, err := b.CompleteFingerprint(ctx, mine.Claim, "fp-mine")
			got <- answer{ok, err}
		}()
		<-entered // the update landed, its reply was lost; the resend waits to connect
		// The done record is purged (its ttl moved to the past) and a
		// newcomer creates the key afresh.
		expireNow(t, direct, e, other, "k")
		if n, err := other.PurgeExpired(ctx, 0); n != 1 || err != nil {
			t.Fatalf("PurgeExpired = %d, %v; want the done record", n, err)
		}
		newcomer, err := other.Claim(ctx, "k", time.Minute)
		if err != nil || newcomer.Outcome != store.Won || newcomer.Claim.Fence != 1 {
			t.Fatalf("the newcomer: %v fence %d %v; want won with fence 1", newcomer.Outcome, newcomer.Claim.Fence, err)
		}
		close(release)
		a := <-got
		t.Logf("the resent complete: %v %v", a.ok, a.err)
		// Its first attempt did complete the key: false (fenced out) would
		// be a lie; the honest answer is an error wrapping the driver's.
		if a.ok || a.err == nil {
			t.Fatalf("the resent complete: %v %v; want an error", a.ok, a.err)
		}
		var ne net.Error
		if !errors.Is(a.err, mysql.ErrInvalidConn) && !errors.Is(a.err, io.ErrUnexpectedEOF) && !errors.Is(a.err, io.EOF) && !errors.As(a.err, &ne) {
			t.Errorf("the error does not wrap the driver's error of the lost reply: %v", a.err)
		}
		if r, err := other.Claim(ctx, "k", time.Minute); err != nil || r.Outcome != store.HeldByOther {
			t.Fatalf("the newcomer's record: %v %v; want still held", r.Outcome, err)
		}
		var stored sql.NullString
		q := "SELECT fingerprint FROM " + tableOf(b) + " WHERE idem_key = ?"
		if e.name == "postgres" {
			q = strings.Replace(q, "?", "$1", 1)
		}
		if err := direct.QueryRowContext(ctx, q, []byte("k")).Scan(&stored); err != nil || stored.Valid {
			t.Fatalf("the newcomer's record holds fingerprint %v (%v), want none", stored, err)
		}
		if ok, err := other.CompleteFingerprint(ctx, newcomer.Claim, "fp-new"); !ok || err != nil {
			t.Fatalf("the newcomer's complete: %v %v", ok, err)
		}
		if r, _ := other.Claim(ctx, "k", time.Minute); r.Fingerprint != "fp-new" {
			t.Fatalf("fingerprint %q, want the newcomer's", r.Fingerprint)
		}
	})
}
