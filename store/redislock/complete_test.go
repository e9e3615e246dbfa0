package redislock_test

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
	"github.com/redis/go-redis/v9"
)

// wonK returns a client of a fresh redis-server, a backend on it and the
// result of its Claim of "k" for a minute, which won.
func wonK(t *testing.T) (*redis.Client, *redislock.Backend, store.Result) {
	t.Helper()
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	r, err := b.Claim(t.Context(), "k", time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim: %v %v", r, err)
	}
	return c, b, r
}

// A claim whose token is the holder's followed by a comma and more is not
// the holder's claim (the port: Complete acts only on a record whose fence
// and token both match): Complete leaves the holder's record alone and
// reports false, and on a done record whose token and fingerprint spell
// that token it reports false too, for that record is not done with it.
func TestCompleteWithATokenThatExtendsTheHoldersByACommaIsNotTheHolder(t *testing.T) {
	c, b, r := wonK(t)
	ctx := t.Context()
	forged := r.Claim
	forged.Token = r.Claim.Token + ",fp"
	if ok, err := b.Complete(ctx, forged); ok || err != nil {
		t.Fatalf("complete with the token %q on a record held by %q: %v %v; want false, nil", forged.Token, r.Claim.Token, ok, err)
	}
	if got := readRecord(t, c, prefixOf(b)+"k"); got.State != "c" || got.Token != r.Claim.Token || got.Fingerprint != "" {
		t.Fatalf("the holder's record after a forged complete: %+v; want still claimed by %q", got, r.Claim.Token)
	}
	if ok, err := b.CompleteFingerprint(ctx, r.Claim, "fp"); !ok || err != nil {
		t.Fatalf("the holder's complete: %v %v", ok, err)
	}
	if ok, err := b.Complete(ctx, forged); ok || err != nil {
		t.Fatalf("complete with the token %q on a record done by %q with fingerprint fp: %v %v; want false, nil", forged.Token, r.Claim.Token, ok, err)
	}
}

// A claim no Claim returns, with a negative fence, is stale like any
// other whose fence the record does not have: Complete reports false, not
// an error.
func TestCompleteWithANegativeFenceIsStaleNotAnError(t *testing.T) {
	_, b, r := wonK(t)
	ctx := t.Context()
	for _, fence := range []int64{-1, -r.Claim.Fence} {
		forged := r.Claim
		forged.Fence = fence
		if ok, err := b.Complete(ctx, forged); ok || err != nil {
			t.Fatalf("complete with fence %d: %v %v; want false, nil", fence, ok, err)
		}
	}
	if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
		t.Fatalf("the holder's complete: %v %v", ok, err)
	}
}

// The record a claim writes is, byte for byte, the claim Claim (or
// Extend) returns, c<fence>,<lease expiry ms>,<token>, whichever script
// path won it (a fresh key, a reclaim, a resend that found its own win)
// and for every lease and ttl up to math.MaxInt64: Complete sends that
// value and settles a record equal to it without decoding it.
func TestTheStoredRecordIsTheClaimReturned(t *testing.T) {
	const forever = time.Duration(math.MaxInt64)
	for _, d := range []struct {
		name       string
		lease, ttl time.Duration
	}{
		{"minute", time.Minute, time.Hour},
		{"max_lease", forever, time.Hour},
		{"max_both", forever, forever},
		{"sub_ms_lease", time.Microsecond, time.Hour},
	} {
		t.Run(d.name, func(t *testing.T) {
			r := newLossRig(t, byBackend, d.ttl)
			ctx := t.Context()
			raw := prefixOf(r.b) + "k"
			want := func(what string, c store.Claim) {
				t.Helper()
				v, err := r.raw.Get(ctx, raw).Result()
				if err != nil {
					t.Fatal(err)
				}
				if w := fmt.Sprintf("c%d,%d,%s", c.Fence, c.LeaseExpiry.UnixMilli(), c.Token); v != w {
					t.Fatalf("after %s the record is %q, want the claim returned, %q", what, v, w)
				}
			}
			fresh, err := r.b.Claim(ctx, "k", d.lease)
			if err != nil || fresh.Outcome != store.Won {
				t.Fatalf("claim: %v %v", fresh, err)
			}
			want("a fresh claim", fresh.Claim)
			ext, err := r.b.Extend(ctx, fresh.Claim, d.lease)
			if err != nil {
				t.Fatal(err)
			}
			want("an extend", ext)
			if err := r.b.Release(ctx, ext); err != nil {
				t.Fatal(err)
			}
			wait := r.loseNextReply(t, nil)
			re, err := r.b.Claim(ctx, "k", d.lease)
			wantResent(t, wait(), true)
			if err != nil || re.Outcome != store.Won || re.Claim.Fence != 3 {
				t.Fatalf("reclaim after a release, its reply lost: %v %v; want won at fence 3", re, err)
			}
			want("a reclaim resent after its lost reply", re.Claim)
			if ok, err := r.b.Complete(ctx, re.Claim); !ok || err != nil {
				t.Fatalf("complete: %v %v", ok, err)
			}
			if v := r.raw.Get(ctx, raw).Val(); v != "d3,,"+re.Claim.Token {
				t.Fatalf("the done record is %q", v)
			}
		})
	}
}
