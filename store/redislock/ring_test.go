package redislock_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// A Ring (client-side sharding, a redis.UniversalClient) is refused: it
// maps a key to a shard by hashing over the shards it currently sees, so
// when one is added, removed, or found down by its heartbeat, keys move to
// another shard that has no record of them. A live claim there is
// invisible: a second caller wins the key beside the holder, and a done
// record is forgotten within its ttl. When New accepts one, the test shows
// the second holder after a shard is added.
func TestNewRefusesARing(t *testing.T) {
	first, second := testsvc.Redis(t), testsvc.StartRedis(t).Addr
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": first}})
	t.Cleanup(func() { ring.Close() })
	b, err := redislock.New(ring, redislock.WithPrefix(prefix()))
	if err != nil {
		if !strings.Contains(err.Error(), "Ring") {
			t.Fatalf("New refuses a Ring with %q, which does not name it", err)
		}
		return
	}
	ctx := t.Context()
	var held []store.Claim
	for i := range 32 {
		r, err := b.Claim(ctx, fmt.Sprint("k", i), time.Hour)
		if err != nil || r.Outcome != store.Won {
			t.Fatal(r.Outcome, err)
		}
		held = append(held, r.Claim)
	}
	ring.SetAddrs(map[string]string{"a": first, "b": second})
	for _, c := range held {
		r, err := b.Claim(ctx, c.Key, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		if r.Outcome == store.Won {
			t.Fatalf("New accepted a Ring: after a shard was added, a second caller won %q (fence %d) while its holder's lease (fence %d) runs for an hour", c.Key, r.Claim.Fence, c.Fence)
		}
	}
	t.Fatal("New accepted a Ring")
}
