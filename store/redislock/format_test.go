package redislock_test

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// v1 runs a script of the earlier record format (a hash with fields s, f,
// l, e, t), as released before the one-string format: testdata/v1 holds
// those scripts unchanged, so the records these tests start from are the
// ones a live deployment has when it upgrades.
func v1(t *testing.T, c *redis.Client, name, raw string, args ...any) *redis.Cmd {
	t.Helper()
	src, err := os.ReadFile("testdata/v1/" + name + ".lua")
	if err != nil {
		t.Fatal(err)
	}
	return c.Eval(t.Context(), string(src), []string{raw}, args...)
}

// v1Claim claims raw with the earlier format's claim.lua and returns the
// claim it won.
func v1Claim(t *testing.T, c *redis.Client, key, raw string, lease, ttl time.Duration) store.Claim {
	t.Helper()
	token := store.NewToken()
	r, err := v1(t, c, "claim", raw, lease.Milliseconds(), ttl.Milliseconds(), token).Int64Slice()
	if err != nil || r[0] != 1 {
		t.Fatalf("v1 claim: %v %v", r, err)
	}
	return store.Claim{Key: key, Fence: r[1], Token: token, LeaseExpiry: time.UnixMilli(r[2])}
}

// Records written by the earlier format keep working after an upgrade:
// a done one is a duplicate until its expires-at (no fingerprint), a live
// claim holds the key until its lease expiry and its holder (an instance
// of the earlier version that claimed it) completes, releases or extends
// it through the new scripts, a lapsed one is reclaimed at the next
// fence. Each write leaves the new format behind, expiring where the port
// says.
func TestRecordsOfTheEarlierFormatKeepWorking(t *testing.T) {
	const ttl = time.Hour
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c, redislock.WithTTL(ttl))
	ctx := t.Context()
	raw := func(k string) string { return prefixOf(b) + k }
	typ := func(k string) string {
		s, err := c.Type(ctx, raw(k)).Result()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	expireAt := func(k string) int64 {
		at, err := c.Do(ctx, "PEXPIRETIME", raw(k)).Int64()
		if err != nil {
			t.Fatal(err)
		}
		return at
	}

	t.Run("done", func(t *testing.T) {
		old := v1Claim(t, c, "done", raw("done"), time.Minute, ttl)
		if n, err := v1(t, c, "complete", raw("done"), old.Fence, ttl.Milliseconds(), old.Token).Int64(); n != 1 || err != nil {
			t.Fatal(n, err)
		}
		e := readRecord(t, c, raw("done")).At
		got, err := b.Claim(ctx, "done", time.Minute)
		if err != nil || got.Outcome != store.AlreadyDone || got.Until.UnixMilli() != e || got.Fingerprint != "" {
			t.Fatalf("claim: %v until %v fingerprint %q %v; want already done until %d, no fingerprint", got.Outcome, got.Until, got.Fingerprint, err, e)
		}
		// The old holder's retried Complete still finds its completion.
		if ok, err := b.Complete(ctx, old); !ok || err != nil {
			t.Fatalf("the old holder's complete, again: %v %v", ok, err)
		}
	})

	t.Run("held, then completed by its holder", func(t *testing.T) {
		old := v1Claim(t, c, "held", raw("held"), time.Minute, ttl)
		got, err := b.Claim(ctx, "held", time.Minute)
		if err != nil || got.Outcome != store.HeldByOther || !got.Until.Equal(old.LeaseExpiry) {
			t.Fatalf("claim: %v until %v %v; want held until %v", got.Outcome, got.Until, err, old.LeaseExpiry)
		}
		if typ("held") != "hash" {
			t.Fatal("a claim that changed nothing rewrote the record")
		}
		before := serverNow(t, c).UnixMilli()
		if ok, err := b.CompleteFingerprint(ctx, old, "fp"); !ok || err != nil {
			t.Fatalf("the old holder's complete: %v %v", ok, err)
		}
		rec := readRecord(t, c, raw("held"))
		if typ("held") != "string" || rec.State != "d" || rec.Fence != old.Fence || rec.Token != old.Token || rec.At < before+ttl.Milliseconds() {
			t.Fatalf("after complete: %s %+v", typ("held"), rec)
		}
		if at := expireAt("held"); at != rec.At {
			t.Fatalf("Redis deletes the key at %d, the record expires at %d", at, rec.At)
		}
		if got, _ := b.Claim(ctx, "held", time.Minute); got.Outcome != store.AlreadyDone || got.Fingerprint != "fp" {
			t.Fatalf("after complete: %v %q", got.Outcome, got.Fingerprint)
		}
	})

	t.Run("held, extended and released by its holder", func(t *testing.T) {
		old := v1Claim(t, c, "ext", raw("ext"), time.Minute, ttl)
		ext, err := b.Extend(ctx, old, 10*time.Minute)
		if err != nil || ext.Fence != old.Fence || !ext.LeaseExpiry.After(old.LeaseExpiry) {
			t.Fatalf("extend: %+v %v", ext, err)
		}
		if rec := readRecord(t, c, raw("ext")); rec.State != "c" || rec.At != ext.LeaseExpiry.UnixMilli() || expireAt("ext") != rec.At+ttl.Milliseconds() {
			t.Fatalf("after extend: %+v expiring at %d", rec, expireAt("ext"))
		}
		if err := b.Release(ctx, ext); err != nil {
			t.Fatal(err)
		}
		got, err := b.Claim(ctx, "ext", time.Minute)
		if err != nil || got.Outcome != store.Won || got.Claim.Fence != old.Fence+2 {
			t.Fatalf("claim after release: %v fence %d %v; want won at fence %d", got.Outcome, got.Claim.Fence, err, old.Fence+2)
		}
	})

	t.Run("released by its holder, unextended", func(t *testing.T) {
		old := v1Claim(t, c, "rel", raw("rel"), time.Minute, ttl)
		if err := b.Release(ctx, old); err != nil {
			t.Fatal(err)
		}
		if rec := readRecord(t, c, raw("rel")); rec.State != "c" || rec.Fence != old.Fence+1 {
			t.Fatalf("after release: %+v", rec)
		}
	})

	t.Run("lapsed, reclaimed", func(t *testing.T) {
		old := v1Claim(t, c, "lapsed", raw("lapsed"), time.Minute, ttl)
		// The old lease lapses: its expiry moved to a millisecond ago on
		// the server's clock (no waiting).
		const lapse = `local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'l', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - 1)`
		if err := c.Eval(ctx, lapse, []string{raw("lapsed")}).Err(); err != nil && err != redis.Nil {
			t.Fatal(err)
		}
		got, err := b.Claim(ctx, "lapsed", time.Minute)
		if err != nil || got.Outcome != store.Won || got.Claim.Fence != old.Fence+1 {
			t.Fatalf("reclaim: %v fence %d %v; want won at fence %d", got.Outcome, got.Claim.Fence, err, old.Fence+1)
		}
		if ok, err := b.Complete(ctx, old); ok || err != nil {
			t.Fatalf("the replaced holder's complete: %v %v; want false", ok, err)
		}
		if typ("lapsed") != "string" || expireAt("lapsed") != got.Claim.LeaseExpiry.UnixMilli()+ttl.Milliseconds() {
			t.Fatalf("after reclaim: %s expiring at %d", typ("lapsed"), expireAt("lapsed"))
		}
	})
}

// An instance still running the earlier version fails on a record the new
// format wrote (WRONGTYPE: an error, so its delivery is nacked and
// redelivered) rather than reading it as absent: during a rolling upgrade
// no key is won twice.
func TestTheEarlierFormatsScriptsFailOnANewRecord(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	r, err := b.Claim(t.Context(), "k", time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatal(r.Outcome, err)
	}
	raw := prefixOf(b) + "k"
	if err := v1(t, c, "claim", raw, 60_000, 3_600_000, store.NewToken()).Err(); err == nil || !strings.Contains(err.Error(), "WRONGTYPE") {
		t.Fatalf("an old claim of a new record: %v, want WRONGTYPE", err)
	}
	if err := v1(t, c, "complete", raw, r.Claim.Fence, 3_600_000, r.Claim.Token).Err(); err == nil || !strings.Contains(err.Error(), "WRONGTYPE") {
		t.Fatalf("an old complete of a new record: %v, want WRONGTYPE", err)
	}
	if rec := readRecord(t, c, raw); rec.State != "c" || rec.Fence != 1 {
		t.Fatalf("the record moved: %+v", rec)
	}
}

// A record takes fewer bytes (MEMORY USAGE) in the one-string format than
// in the earlier hash, for the same key, claimed and done.
func TestARecordTakesFewerBytesThanTheEarlierFormat(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	ctx := t.Context()
	usage := func(k string) int64 {
		n, err := c.MemoryUsage(ctx, prefixOf(b)+k).Result()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	old := v1Claim(t, c, "old:000001", prefixOf(b)+"old:000001", time.Minute, time.Hour)
	oldClaimed := usage("old:000001")
	v1(t, c, "complete", prefixOf(b)+"old:000001", old.Fence, 3_600_000, old.Token)
	oldDone := usage("old:000001")
	r, _ := b.Claim(ctx, "new:000001", time.Minute)
	newClaimed := usage("new:000001")
	b.Complete(ctx, r.Claim)
	newDone := usage("new:000001")
	t.Logf("MEMORY USAGE claimed: %d bytes (earlier format %d); done: %d (%d)", newClaimed, oldClaimed, newDone, oldDone)
	if newClaimed >= oldClaimed || newDone >= oldDone {
		t.Fatalf("claimed %d bytes (earlier %d), done %d (earlier %d): want fewer", newClaimed, oldClaimed, newDone, oldDone)
	}
}
