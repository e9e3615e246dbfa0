package redislock

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"
)

// infoer is the method of every go-redis client that runs INFO.
type infoer interface {
	Info(ctx context.Context, section ...string) *redis.StringCmd
}

// CheckEviction returns an error unless every server behind the client
// keeps records until their expires-at instant: a server with a memory
// limit (maxmemory) evicts keys under memory pressure with every
// maxmemory-policy but noeviction, and each record has an expiry, so the
// volatile-* policies evict records too (Memorystore's default is
// volatile-lru). An evicted Done record lets its key run again within the
// ttl; an evicted Claimed record lets a second holder in beside a live
// one. Call it once at start-up. A server with no memory limit, or with
// noeviction (whose writes then fail when memory is full, and Claim
// returns an error), passes.
func (b *Backend) CheckEviction(ctx context.Context) error {
	if cc, ok := b.client.(*redis.ClusterClient); ok {
		return cc.ForEachShard(ctx, func(ctx context.Context, c *redis.Client) error {
			return checkEviction(ctx, c)
		})
	}
	i, ok := b.client.(infoer)
	if !ok {
		return fmt.Errorf("redislock: check eviction: the client %T cannot run INFO", b.client)
	}
	return checkEviction(ctx, i)
}

func checkEviction(ctx context.Context, c infoer) error {
	info, err := c.Info(ctx, "memory").Result()
	if err != nil {
		return fmt.Errorf("redislock: check eviction: INFO memory: %w", err)
	}
	var maxmemory, policy string
	for _, line := range strings.Split(info, "\n") {
		k, v, _ := strings.Cut(strings.TrimSpace(line), ":")
		switch k {
		case "maxmemory":
			maxmemory = v
		case "maxmemory_policy":
			policy = v
		}
	}
	if maxmemory == "" || policy == "" {
		return errors.New("redislock: check eviction: INFO memory reports no maxmemory or maxmemory_policy")
	}
	if maxmemory != "0" && policy != "noeviction" {
		return fmt.Errorf("redislock: the server has maxmemory %s bytes and maxmemory-policy %s: it may evict a record before its expires-at (set maxmemory-policy noeviction)", maxmemory, policy)
	}
	return nil
}
