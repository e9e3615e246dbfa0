package redislock_test

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// setAtNow rewrites the record at KEYS[1] with state ARGV[1] and its
// instant at the server's now (ms) plus ARGV[2], keeping its fence and
// token, and returns now: for claimed ("c") the lease expiry (the key's
// expiry is kept), for done ("d") the expires-at, which is the key's
// expiry (a negative offset deletes the key). A key that is gone (a done
// record set to expire a millisecond ahead, by the previous call) is
// written afresh at fence ARGV[3].
const setAtNow = `
local v = redis.call('GET', KEYS[1]) or ('d' .. ARGV[3] .. ',,gone')
local f, t = string.match(v, '^[cd](%d+),%d*,([^,]*)')
local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
local at = string.format('%d', now + tonumber(ARGV[2]))
if ARGV[1] == 'c' then
  redis.call('SET', KEYS[1], 'c' .. f .. ',' .. at .. ',' .. t, 'KEEPTTL')
else
  redis.call('SET', KEYS[1], 'd' .. f .. ',,' .. t, 'PXAT', at)
end
return now`

// readNow returns the server's now (ms).
const readNow = `
local t = redis.call('TIME')
return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)`

// atInstant runs, in one MULTI, a script that puts the record in state
// with its instant at the server's now + offset ms, claim.lua, and a
// script that reads now again. It returns claim.lua's outcome, fence and
// instant, and whether both clock reads fell in the same millisecond, in
// which case claim.lua judged at exactly that millisecond.
//
// A done record's expires-at is its key's expiry, which Redis refuses to
// set at now (it deletes the key instead); for a done record at offset 0
// atInstant sets it a millisecond ahead and then claims, in MULTIs that
// read the clock before and after, until a claim runs in that millisecond
// (exact) or after it.
func atInstant(t *testing.T, c *redis.Client, key, state string, offset, fence int64) (reply []int64, exact bool) {
	t.Helper()
	ctx := t.Context()
	claimReply := func(claim *redis.Cmd) []int64 {
		if lease, ok := claim.Val().(int64); ok { // a key with no record won: fence 1
			return []int64{1, 1, lease}
		}
		v, err := claim.Slice()
		if err != nil || len(v) < 3 {
			t.Fatal(v, err)
		}
		var r []int64
		for _, x := range v[:3] {
			r = append(r, x.(int64))
		}
		return r
	}
	if state == "d" && offset == 0 {
		at, err := c.Eval(ctx, setAtNow, []string{key}, state, 1, fence).Int64()
		if err != nil {
			t.Fatal(err)
		}
		at++ // the expires-at
		for {
			var before, claim, after *redis.Cmd
			if _, err := c.TxPipelined(ctx, func(p redis.Pipeliner) error {
				before = p.Eval(ctx, readNow, nil)
				claim = p.Eval(ctx, redislock.ClaimLua, []string{key}, 60_000, 3_600_000, store.NewToken())
				after = p.Eval(ctx, readNow, nil)
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			b, _ := before.Int64()
			a, _ := after.Int64()
			r := claimReply(claim)
			if a < at { // judged before the expires-at: still done
				if r[0] != 2 {
					t.Fatalf("a claim judged before the expires-at got %v", r)
				}
				continue
			}
			if b < at && r[0] == 2 { // judged before it, maybe: try again
				continue
			}
			return r, b == at && a == at
		}
	}
	var set, claim, after *redis.Cmd
	_, err := c.TxPipelined(ctx, func(p redis.Pipeliner) error {
		set = p.Eval(ctx, setAtNow, []string{key}, state, offset, fence)
		claim = p.Eval(ctx, redislock.ClaimLua, []string{key}, 60_000, 3_600_000, store.NewToken())
		after = p.Eval(ctx, readNow, nil)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	s, _ := set.Int64()
	a, _ := after.Int64()
	return claimReply(claim), s == a
}

// claimAtTheBoundary claims a record, then claims it again and again with
// the record in state and its instant (lease expiry or expires-at) set to
// the server's now or to a millisecond after it, and checks the boundary on the
// server's own clock, in the tries where the whole MULTI ran within one
// millisecond: a claim judged at the instant wins (fence + 1), one judged a
// millisecond before gets blocked (HeldByOther's 3 or AlreadyDone's 2).
func claimAtTheBoundary(t *testing.T, state string, blocked int64) {
	t.Helper()
	field := map[string]string{"c": "the lease expiry", "d": "expires-at"}[state]
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
		offset := int64(try % 2) // the instant at now, or a millisecond after now
		reply, exact := atInstant(t, c, raw, state, offset, fence)
		switch {
		case reply[0] == 1:
			if offset == 1 && exact {
				t.Fatalf("a claim judged a millisecond before %s won (fence %d)", field, reply[1])
			}
			// A done key's record past its expires-at may be gone (Redis
			// deletes it once now > expires-at): a fresh record at fence 1.
			if reply[1] != fence+1 && (exact || state != "d" || reply[1] != 1) {
				t.Fatalf("reclaim took fence %d, want %d", reply[1], fence+1)
			}
			fence = reply[1]
		case reply[0] == blocked:
			if offset == 0 {
				t.Fatalf("a claim judged at (or after) %s got %d (until %d), want a win", field, reply[0], reply[2])
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
	t.Logf("exact hits: at %s %d, a millisecond before %d", field, hits[0], hits[1])
}

// A lease ends exactly at its expiry: a claim judged at the
// lease expiry's millisecond wins (now >= lease expiry), one judged a
// millisecond before is held.
func TestALeaseEndsExactlyAtItsExpiry(t *testing.T) {
	claimAtTheBoundary(t, "c", 3)
}

// A done key's ttl ends exactly at its expires-at instant: a
// claim judged then wins it back (fence + 1), one judged a millisecond
// before is already done.
func TestATTLEndsExactlyAtExpiresAt(t *testing.T) {
	claimAtTheBoundary(t, "d", 2)
}

// record reads the stored record and the key's expiry (PEXPIRETIME) in
// ms: a claimed record stores its lease expiry l and expires at the key's
// expiry (e is that expiry), a done one stores its expires-at e (l is 0).
func record(t *testing.T, c *redis.Client, raw string) (s string, f, l, e, expireAt int64) {
	t.Helper()
	r := readRecord(t, c, raw)
	at, err := c.Do(t.Context(), "PEXPIRETIME", raw).Int64()
	if err != nil {
		t.Fatal(err)
	}
	if r.State == "c" {
		return r.State, r.Fence, r.At, at, at
	}
	return r.State, r.Fence, 0, r.At, at
}

// Every script sets the record's expires-at as the port defines it, by the
// server's clock, and has Redis delete the key at that very instant
// (the key expires at e: Redis deletes only once now > e), never before:
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

// Every instant the backend reports is on the server's clock, and expiry
// is judged against what the record stores, by the server: a client's own
// clock never enters the decision.
func TestExpiryIsJudgedByTheServerClock(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	ctx := t.Context()

	before := serverNow(t, c)
	r, err := b.Claim(ctx, "k", 30*time.Second)
	after := serverNow(t, c)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim: %v %v", r.Outcome, err)
	}
	lo, hi := before.Add(30*time.Second).Truncate(time.Millisecond), after.Add(30*time.Second)
	if r.Claim.LeaseExpiry.Before(lo) || r.Claim.LeaseExpiry.After(hi) {
		t.Fatalf("lease expiry %v outside the server's [%v, %v] + lease", r.Claim.LeaseExpiry, lo, hi)
	}

	// Move the stored lease expiry to one millisecond before the server's
	// now: the very next claim reclaims, whatever the client believes.
	rawKey := prefixOf(b) + "k"
	if err := c.Eval(ctx, setAtNow, []string{rawKey}, "c", -1, 0).Err(); err != nil {
		t.Fatal(err)
	}
	r2, err := b.Claim(ctx, "k", 30*time.Second)
	if err != nil || r2.Outcome != store.Won || r2.Claim.Fence != 2 {
		t.Fatalf("claim after the server-judged lapse: %v fence %d %v", r2.Outcome, r2.Claim.Fence, err)
	}
	// And a lease ten seconds ahead on the server's clock is live.
	if err := c.Eval(ctx, setAtNow, []string{rawKey}, "c", 10_000, 0).Err(); err != nil {
		t.Fatal(err)
	}
	if r3, err := b.Claim(ctx, "k", time.Second); err != nil || r3.Outcome != store.HeldByOther {
		t.Fatalf("claim within the server-judged lease: %v %v", r3.Outcome, err)
	}
}

// The record lives exactly as long as the contract needs: a claimed one
// until lease + ttl, a done one until completion + ttl.
func TestRedisReapsRecordsAtExpiresAt(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c, redislock.WithTTL(time.Hour))
	ctx := t.Context()
	raw := prefixOf(b) + "k"
	pttl := func() time.Duration {
		d, err := c.PTTL(ctx, raw).Result()
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	near := func(got, want time.Duration) bool { return got <= want && got > want-5*time.Second }

	r, _ := b.Claim(ctx, "k", 15*time.Minute)
	if got := pttl(); !near(got, 75*time.Minute) {
		t.Fatalf("claimed record PTTL %v, want lease + ttl = 75m", got)
	}
	b.Release(ctx, r.Claim)
	if got := pttl(); !near(got, time.Hour) {
		t.Fatalf("released record PTTL %v, want ttl = 1h", got)
	}
	r, _ = b.Claim(ctx, "k", 15*time.Minute)
	b.Complete(ctx, r.Claim)
	if got := pttl(); !near(got, time.Hour) {
		t.Fatalf("done record PTTL %v, want ttl = 1h", got)
	}
	f := readRecord(t, c, raw).Fence
	if f != 3 {
		t.Fatalf("stored fence %d, want 3 (claim, release, reclaim)", f)
	}
}
