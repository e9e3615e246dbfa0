// Package redislock is a store.Backend on Redis (or Memorystore), through
// go-redis v9.
//
// Each operation is one Lua script on one key, run with EVALSHA (falling
// back to EVAL once, when the server does not have the script yet), so a
// delivery costs two round trips: Claim before the work, Complete after it.
// Expiry is judged by the server's clock (TIME inside the script), so
// clients whose clocks disagree still agree on when a lease lapses. One key
// per record makes every operation Redis Cluster safe; a key with a
// {hash tag} lands in that tag's slot.
//
// A record is a hash under prefix+key with the fields s (state: "c" or
// "d"), f (fence), l (lease expiry, Unix ms), e (expires at, Unix ms) and t
// (the winning claim's token). The key is set to expire at e with
// PEXPIREAT, so Redis deletes a record exactly when the contract allows and
// not before. A Redis that loses writes on restart (no AOF, no replica)
// loses records with them: a delivery in flight may then run twice.
package redislock

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var (
	//go:embed claim.lua
	claimLua string
	//go:embed complete.lua
	completeLua string
	//go:embed release.lua
	releaseLua string
	//go:embed extend.lua
	extendLua string

	claimScript    = redis.NewScript(claimLua)
	completeScript = redis.NewScript(completeLua)
	releaseScript  = redis.NewScript(releaseLua)
	extendScript   = redis.NewScript(extendLua)
)

// DefaultPrefix is put in front of every key unless WithPrefix says
// otherwise.
const DefaultPrefix = "idempotency:"

// Option configures a Backend.
type Option func(*Backend)

// WithPrefix sets the prefix of every Redis key the backend writes. Give
// each application sharing a Redis its own.
func WithPrefix(prefix string) Option {
	return func(b *Backend) { b.prefix = prefix }
}

// WithTTL sets how long a completed key suppresses duplicates, and how long
// a claimed record outlives its lease. Default store.DefaultTTL.
func WithTTL(ttl time.Duration) Option {
	return func(b *Backend) { b.ttl = ttl }
}

// WithClaimRetries sets how many more times Claim sends its script, with
// the same claim token, after a network error left the outcome unknown.
// Default 2. go-redis may also retry on its own (its MaxRetries); both are
// safe, because a retry that finds its own token re-affirms the claim.
func WithClaimRetries(n int) Option {
	return func(b *Backend) { b.retries = n }
}

// Backend is a store.Backend on Redis. It is safe for concurrent use.
type Backend struct {
	client  redis.Scripter
	prefix  string
	ttl     time.Duration
	retries int
}

var (
	_ store.Backend  = (*Backend)(nil)
	_ store.Extender = (*Backend)(nil)
)

// New returns a Backend over client: a *redis.Client, *redis.ClusterClient,
// a failover client or any redis.UniversalClient. It does no I/O. It fails
// on a nil client, a non-positive ttl, or a prefix longer than
// store.MaxKeyLen.
func New(client redis.Scripter, opts ...Option) (*Backend, error) {
	b := &Backend{client: client, prefix: DefaultPrefix, ttl: store.DefaultTTL, retries: 2}
	for _, o := range opts {
		o(b)
	}
	if client == nil {
		return nil, errors.New("redislock: nil client")
	}
	if err := store.ValidateTTL(b.ttl); err != nil {
		return nil, fmt.Errorf("redislock: %w", err)
	}
	if len(b.prefix) > store.MaxKeyLen {
		return nil, fmt.Errorf("redislock: prefix of %d bytes is longer than %d", len(b.prefix), store.MaxKeyLen)
	}
	if b.retries < 0 {
		return nil, fmt.Errorf("redislock: claim retries %d is negative", b.retries)
	}
	return b, nil
}

// TTL returns the ttl the backend applies.
func (b *Backend) TTL() time.Duration { return b.ttl }

func millis(d time.Duration) int64 {
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}

// retryable reports whether err left a script's outcome unknown in a way a
// resend may clear: a broken connection, not a reply from the server or
// the caller's context ending.
func retryable(ctx context.Context, err error) bool {
	if ctx.Err() != nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var rerr redis.Error
	if errors.As(err, &rerr) {
		msg := rerr.Error()
		for _, p := range []string{"LOADING", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY"} {
			if len(msg) >= len(p) && msg[:len(p)] == p {
				return true
			}
		}
		return false
	}
	return true
}

// Claim implements store.Backend.
func (b *Backend) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Result{}, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return store.Result{}, err
	}
	token := store.NewToken()
	args := []any{millis(lease), millis(b.ttl), token}
	var (
		reply []int64
		err   error
	)
	for attempt := 0; ; attempt++ {
		reply, err = claimScript.Run(ctx, b.client, []string{b.prefix + key}, args...).Int64Slice()
		if err == nil || attempt >= b.retries || !retryable(ctx, err) {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(attempt+1) * 20 * time.Millisecond):
		}
	}
	if err != nil {
		return store.Result{}, fmt.Errorf("redislock: claim %q (outcome unknown: the key may be held until its lease lapses): %w", key, err)
	}
	if len(reply) != 3 {
		return store.Result{}, fmt.Errorf("redislock: claim %q: unexpected reply %v", key, reply)
	}
	at := time.UnixMilli(reply[2])
	switch reply[0] {
	case 1:
		return store.Result{Outcome: store.Won, Claim: store.Claim{Key: key, Fence: reply[1], Token: token, LeaseExpiry: at}}, nil
	case 2:
		return store.Result{Outcome: store.AlreadyDone, Until: at}, nil
	case 3:
		return store.Result{Outcome: store.HeldByOther, Until: at}, nil
	}
	return store.Result{}, fmt.Errorf("redislock: claim %q: unexpected outcome %d", key, reply[0])
}

// Complete implements store.Backend.
func (b *Backend) Complete(ctx context.Context, c store.Claim) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	n, err := completeScript.Run(ctx, b.client, []string{b.prefix + c.Key}, c.Fence, millis(b.ttl)).Int64()
	if err != nil {
		return false, fmt.Errorf("redislock: complete %q fence %d: %w", c.Key, c.Fence, err)
	}
	return n == 1, nil
}

// Release implements store.Backend.
func (b *Backend) Release(ctx context.Context, c store.Claim) error {
	if err := store.ValidateKey(c.Key); err != nil {
		return err
	}
	if err := releaseScript.Run(ctx, b.client, []string{b.prefix + c.Key}, c.Fence, millis(b.ttl)).Err(); err != nil {
		return fmt.Errorf("redislock: release %q fence %d: %w", c.Key, c.Fence, err)
	}
	return nil
}

// Extend implements store.Extender.
func (b *Backend) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return c, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return c, err
	}
	ms, err := extendScript.Run(ctx, b.client, []string{b.prefix + c.Key}, c.Fence, millis(lease), millis(b.ttl)).Int64()
	if err != nil {
		return c, fmt.Errorf("redislock: extend %q fence %d: %w", c.Key, c.Fence, err)
	}
	if ms == 0 {
		return c, fmt.Errorf("redislock: extend %q fence %d: %w", c.Key, c.Fence, store.ErrLost)
	}
	c.LeaseExpiry = time.UnixMilli(ms)
	return c, nil
}

// String describes the backend, for logs.
func (b *Backend) String() string {
	return "redislock(prefix=" + strconv.Quote(b.prefix) + ", ttl=" + b.ttl.String() + ")"
}
