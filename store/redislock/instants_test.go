package redislock_test

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// setAtNow sets field ARGV[1] of KEYS[1] to the server's now (ms) plus
// ARGV[2], sets the optional field ARGV[3] to ARGV[4], and returns now.
const setAtNow = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], now + tonumber(ARGV[2]))
if ARGV[3] then redis.call('HSET', KEYS[1], ARGV[3], ARGV[4]) end
return now`

// readNow returns the server's now (ms).
const readNow = `
local t = redis.call('TIME')
return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)`

// atInstant runs, in one MULTI, a script that sets field to the server's
// now + offset ms, claim.lua, and a script that reads now again. It returns
// claim.lua's reply and whether both clock reads fell in the same
// millisecond, in which case claim.lua judged at exactly that millisecond.
func atInstant(t *testing.T, c *redis.Client, key, field string, offset int64, extra ...string) (reply []int64, exact bool) {
	t.Helper()
	args := []any{field, offset}
	for _, e := range extra {
		args = append(args, e)
	}
	var set, claim, after *redis.Cmd
	_, err := c.TxPipelined(t.Context(), func(p redis.Pipeliner) error {
		set = p.Eval(t.Context(), setAtNow, []string{key}, args...)
		claim = p.Eval(t.Context(), redislock.ClaimLua, []string{key}, 60_000, 3_600_000, store.NewToken())
		after = p.Eval(t.Context(), readNow, nil)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	reply, err = claim.Int64Slice()
	if err != nil {
		t.Fatal(err)
	}
	s, _ := set.Int64()
	a, _ := after.Int64()
	return reply, s == a
}

// A lease ends exactly at its expiry: a claim judged at the lease expiry's
// millisecond wins (now >= lease expiry), one judged a millisecond before
// is held. Each boundary is checked on the server's own clock, in the
// tries where the whole MULTI ran within one millisecond.
func TestALeaseEndsExactlyAtItsExpiry(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	k := "k"
	raw := prefixOf(b) + k
	first, err := b.Claim(t.Context(), k, time.Hour)
	if err != nil || first.Outcome != store.Won {
		t.Fatal(first.Outcome, err)
	}
	fence := first.Claim.Fence
	hits := map[int64]int{}
	for try := 0; try < 500 && (hits[0] < 5 || hits[1] < 5); try++ {
		offset := int64(try % 2) // lease expiry at now, or a millisecond after now
		reply, exact := atInstant(t, c, raw, "l", offset)
		switch {
		case reply[0] == 1:
			if offset == 1 && exact {
				t.Fatalf("a claim judged a millisecond before the lease expiry won it (fence %d)", reply[1])
			}
			if reply[1] != fence+1 {
				t.Fatalf("reclaim took fence %d, want %d", reply[1], fence+1)
			}
			fence = reply[1]
		case reply[0] == 3:
			if offset == 0 {
				t.Fatalf("a claim judged at (or after) the lease expiry was held (until %d)", reply[2])
			}
		default:
			t.Fatalf("claim reply %v", reply)
		}
		if exact {
			hits[offset]++
		}
	}
	if hits[0] == 0 || hits[1] == 0 {
		t.Fatalf("the boundary was hit %v times (offset 0 and 1 ms): the server was too slow to test it", hits)
	}
	t.Logf("exact hits: at the expiry %d, a millisecond before %d", hits[0], hits[1])
}

// A done key's ttl ends exactly at its expires-at instant: a claim judged
// then wins it back (fence + 1), one judged a millisecond before is
// already done.
func TestATTLEndsExactlyAtExpiresAt(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	k := "k"
	raw := prefixOf(b) + k
	first, err := b.Claim(t.Context(), k, time.Hour)
	if err != nil || first.Outcome != store.Won {
		t.Fatal(first.Outcome, err)
	}
	fence := first.Claim.Fence
	hits := map[int64]int{}
	for try := 0; try < 500 && (hits[0] < 5 || hits[1] < 5); try++ {
		offset := int64(try % 2)
		reply, exact := atInstant(t, c, raw, "e", offset, "s", "d")
		switch {
		case reply[0] == 1:
			if offset == 1 && exact {
				t.Fatalf("a claim judged a millisecond before the ttl ended won the done key (fence %d)", reply[1])
			}
			if reply[1] != fence+1 {
				t.Fatalf("reclaim took fence %d, want %d", reply[1], fence+1)
			}
			fence = reply[1]
		case reply[0] == 2:
			if offset == 0 {
				t.Fatalf("a claim judged at (or after) expires-at found the key already done (until %d)", reply[2])
			}
		default:
			t.Fatalf("claim reply %v", reply)
		}
		if exact {
			hits[offset]++
		}
	}
	if hits[0] == 0 || hits[1] == 0 {
		t.Fatalf("the boundary was hit %v times (offset 0 and 1 ms): the server was too slow to test it", hits)
	}
	t.Logf("exact hits: at expires-at %d, a millisecond before %d", hits[0], hits[1])
}

// record reads the stored fields and the key's expiry (PEXPIRETIME) in ms.
func record(t *testing.T, c *redis.Client, raw string) (s string, f, l, e, expireAt int64) {
	t.Helper()
	ctx := t.Context()
	v, err := c.HMGet(ctx, raw, "s", "f", "l", "e").Result()
	if err != nil {
		t.Fatal(err)
	}
	num := func(x any) int64 {
		var n int64
		if str, ok := x.(string); ok {
			for _, ch := range str {
				n = n*10 + int64(ch-'0')
			}
		}
		return n
	}
	s, _ = v[0].(string)
	at, err := c.Do(ctx, "PEXPIRETIME", raw).Int64()
	if err != nil {
		t.Fatal(err)
	}
	return s, num(v[1]), num(v[2]), num(v[3]), at
}

// Every script sets the record's expires-at as the port defines it, by the
// server's clock, and has Redis delete the key at that very instant
// (PEXPIREAT e: Redis deletes only once now > e), never before:
//   - claimed: lease expiry + ttl;
//   - extended: the new lease expiry + ttl;
//   - released: the release time + ttl, with the lease expiry at the
//     release time;
//   - done: the completion time + ttl (not the claim's, not shorter), and
//     a second Complete moves nothing.
func TestExpiresAtIsWhatThePortSaysAndRedisDeletesNoSooner(t *testing.T) {
	const ttl = time.Hour
	const ttlMs = int64(ttl / time.Millisecond)
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c, redislock.WithTTL(ttl))
	ctx := t.Context()
	k := "k"
	raw := prefixOf(b) + k
	ms := func() int64 { return serverNow(t, c).UnixMilli() }
	check := func(what, wantS string, wantE func(l int64) (lo, hi int64)) (f, l, e int64) {
		t.Helper()
		s, f, l, e, at := record(t, c, raw)
		lo, hi := wantE(l)
		if s != wantS || e < lo || e > hi {
			t.Fatalf("%s: state %q expires-at %d; want %q and expires-at in [%d, %d]", what, s, e, wantS, lo, hi)
		}
		if at != e {
			t.Fatalf("%s: Redis deletes the key at %d, the record expires at %d", what, at, e)
		}
		return f, l, e
	}

	won := func() store.Claim {
		t.Helper()
		r, err := b.Claim(ctx, k, 15*time.Minute)
		if err != nil || r.Outcome != store.Won {
			t.Fatalf("claim: %v %v", r.Outcome, err)
		}
		return r.Claim
	}
	r := store.Result{Claim: won()}
	check("claimed", "c", func(l int64) (int64, int64) { return l + ttlMs, l + ttlMs })
	if l := r.Claim.LeaseExpiry.UnixMilli(); l != func() int64 { _, _, l, _, _ := record(t, c, raw); return l }() {
		t.Fatalf("reported lease expiry %d differs from the stored one", l)
	}

	if _, err := b.Extend(ctx, r.Claim, 30*time.Minute); err != nil {
		t.Fatal(err)
	}
	check("extended", "c", func(l int64) (int64, int64) { return l + ttlMs, l + ttlMs })

	before := ms()
	if err := b.Release(ctx, r.Claim); err != nil {
		t.Fatal(err)
	}
	after := ms()
	_, l, _ := check("released", "c", func(l int64) (int64, int64) { return l + ttlMs, l + ttlMs })
	if l < before || l > after {
		t.Fatalf("released: lease expiry %d is not the release time [%d, %d]", l, before, after)
	}

	r.Claim = won() // the release made the key claimable at once
	claimedAt := ms()
	time.Sleep(300 * time.Millisecond) // the work
	before = ms()
	if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
		t.Fatal(ok, err)
	}
	after = ms()
	_, _, e := check("done", "d", func(int64) (int64, int64) { return before + ttlMs, after + ttlMs })
	if e < claimedAt+300+ttlMs-5 {
		t.Fatalf("done: expires-at %d counts the ttl from the claim (%d), not the completion", e, claimedAt)
	}
	time.Sleep(5 * time.Millisecond)
	if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
		t.Fatal(ok, err)
	}
	check("done, completed again", "d", func(int64) (int64, int64) { return e, e })
	if err := b.Release(ctx, r.Claim); err != nil {
		t.Fatal(err)
	}
	check("done, released", "d", func(int64) (int64, int64) { return e, e })
	if got, _ := b.Claim(ctx, k, time.Minute); got.Outcome != store.AlreadyDone || got.Until.UnixMilli() != e {
		t.Fatalf("claim of the done key: %v until %v, want already done until %d", got.Outcome, got.Until, e)
	}
	check("done, claimed again", "d", func(int64) (int64, int64) { return e, e })
}
