package redislock_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// The port: a backend MUST NOT delete a record before its expires-at
// instant. Every record carries a Redis expiry, so a server with a memory
// limit and any eviction policy but noeviction (allkeys-*, and volatile-*
// too: Memorystore's default is volatile-lru) may evict a record long
// before it: a Done key evicted within its ttl is claimed and run again.
// The first half shows the danger on a real server; the second that
// CheckEviction refuses such a server and accepts a safe one.
func TestNeverDeletesBeforeExpiresAtEvictionPolicyIsChecked(t *testing.T) {
	ctx := t.Context()
	srv := testsvc.StartRedis(t, "--maxmemory", "2mb", "--maxmemory-policy", "volatile-lru")
	c := client(t, srv.Addr)
	b := newBackend(t, c, redislock.WithTTL(time.Hour))
	res, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || res.Outcome != store.Won {
		t.Fatalf("claim: %v %v", res, err)
	}
	if ok, err := b.Complete(ctx, res.Claim); !ok || err != nil {
		t.Fatalf("complete: %v %v", ok, err)
	}
	// Other keys with an expiry (another app's cache, say) fill memory.
	big := strings.Repeat("x", 1024)
	evicted := false
	for i := 0; i < 20000 && !evicted; i++ {
		if err := c.Set(ctx, fmt.Sprintf("filler:%d", i), big, time.Hour).Err(); err != nil {
			t.Fatal(err)
		}
		if i%500 == 499 {
			again, err := b.Claim(ctx, "k", time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			evicted = again.Outcome == store.Won
		}
	}
	if !evicted {
		t.Fatal("the done record survived the memory pressure: the demonstration needs more filler")
	}
	t.Log("volatile-lru evicted a done record within its ttl: the key was won again")

	if err := b.CheckEviction(ctx); err == nil {
		t.Error("CheckEviction accepted maxmemory 2mb with volatile-lru")
	}
	for _, policy := range []string{"allkeys-lru", "volatile-ttl", "allkeys-random"} {
		if err := c.ConfigSet(ctx, "maxmemory-policy", policy).Err(); err != nil {
			t.Fatal(err)
		}
		if err := b.CheckEviction(ctx); err == nil {
			t.Errorf("CheckEviction accepted maxmemory 2mb with %s", policy)
		}
	}
	if err := c.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err(); err != nil {
		t.Fatal(err)
	}
	if err := b.CheckEviction(ctx); err != nil {
		t.Errorf("CheckEviction refused noeviction: %v", err)
	}
	if err := c.ConfigSet(ctx, "maxmemory-policy", "allkeys-lru").Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.ConfigSet(ctx, "maxmemory", "0").Err(); err != nil {
		t.Fatal(err)
	}
	if err := b.CheckEviction(ctx); err != nil {
		t.Errorf("CheckEviction refused a server without a memory limit: %v", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := b.CheckEviction(cctx); err == nil || !strings.Contains(err.Error(), context.Canceled.Error()) {
		t.Errorf("CheckEviction with a cancelled ctx: %v", err)
	}
}
