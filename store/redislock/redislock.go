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
// loses records with them: a delivery in flight may then run twice. So
// does a failover to a replica that had not yet received the latest
// writes (replication is asynchronous; Memorystore's standard tier fails
// over this way).
//
// Complete, Release and Extend act on a record only when both its fence
// and its token are the claim's: the fence decides, as the port says, and
// the token tells apart a record that Redis deleted at its expires-at and
// another caller created afresh, whose fence restarted at 1.
//
// Redis may delete a record early on its own when memory is short: a
// server with a maxmemory limit must use maxmemory-policy noeviction (every
// record has an expiry, so the volatile-* policies evict records too).
// CheckEviction tells; call it at start-up.
//
// After a network error that may have come after the server ran a script
// (a lost reply), the backend resends it itself (see WithClaimRetries) and
// reads the resend's reply for what it can prove; go-redis's own resends
// are turned off for these scripts.
package redislock

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
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

	claimScript    = newScript(claimLua)
	completeScript = newScript(completeLua)
	releaseScript  = newScript(releaseLua)
	extendScript   = newScript(extendLua)
)

// script is a Lua script with its source, for the EVAL that follows a
// NOSCRIPT reply.
type script struct {
	*redis.Script
	src string
}

func newScript(src string) script { return script{redis.NewScript(src), src} }

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

// WithClaimRetries sets how many more times each operation (Claim,
// Complete, Release) sends its script, with the same arguments, after a
// network error left the outcome unknown. Default 2. Extend is resent only
// after an attempt that surely did not run (a failed dial, a server that
// refused it): a resend would move the lease a second time.
//
// The backend resends, not go-redis: it tells go-redis not to resend its
// scripts (the command's NoRetry), whatever the client's MaxRetries, because
// only the backend knows that an attempt is a resend and what the reply to a
// resend can prove. A resent Claim answers Won only when it finds its own
// token in the record (the lost attempt won); when it finds anything else
// (the key held by another, done, free, or gone) it cannot tell whether its
// lost attempt won the key before the key moved on, so it changes nothing
// and returns an error: neither a guess at not won nor a second win. A
// resent Complete that finds the record no longer its own returns an error
// for the same reason. Clients that do not implement Process (none of
// go-redis's) run the scripts through redis.Script.Run, and go-redis may
// resend them unseen.
func WithClaimRetries(n int) Option {
	return func(b *Backend) { b.retries = n }
}

// Backend is a store.Backend on Redis. It is safe for concurrent use.
type Backend struct {
	client  redis.Scripter
	prefix  string
	ttl     time.Duration
	retries int
	backoff time.Duration // the first retry's wait; the n-th waits n times as long
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
	b := &Backend{client: client, prefix: DefaultPrefix, ttl: store.DefaultTTL, retries: 2, backoff: 20 * time.Millisecond}
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
// resend may clear: a broken connection, or a server reply that refused the
// command before it ran; not any other reply, nor the caller's context
// ending.
func retryable(ctx context.Context, err error) bool {
	if ctx.Err() != nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var rerr redis.Error
	if errors.As(err, &rerr) {
		return refused(rerr)
	}
	return true
}

// refused reports whether a server's error reply says the command was
// turned away before it ran.
func refused(err redis.Error) bool {
	msg := err.Error()
	for _, p := range []string{"LOADING", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY"} {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	return false
}

// mayHaveRun reports whether a failed attempt may have run its script:
// anything but a reply from the server (our scripts raise no error after a
// write), a failure to connect, or a failure to send.
func mayHaveRun(err error) bool {
	var rerr redis.Error
	if errors.As(err, &rerr) {
		return false
	}
	// A failed dial sent nothing; a failed write sent part of the command
	// at most, which the server never runs.
	var op *net.OpError
	if errors.As(err, &op) && (op.Op == "dial" || op.Op == "write") {
		return false
	}
	return !errors.Is(err, redis.ErrPoolTimeout)
}

// processor is the method of every go-redis client (Client, ClusterClient,
// Ring, failover clients) that runs a command built by hand.
type processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// onceCmd is a script command that go-redis must not resend on its own
// after a network error: whether to resend, and what the reply to a resend
// proves, is the backend's to decide.
type onceCmd struct{ *redis.Cmd }

// NoRetry tells go-redis not to resend the command.
func (onceCmd) NoRetry() bool { return true }

// eval sends s once on key: EVALSHA, then EVAL when the server does not
// have the script.
func (b *Backend) eval(ctx context.Context, s script, key string, args []any) *redis.Cmd {
	p, ok := b.client.(processor)
	if !ok {
		return s.Run(ctx, b.client, []string{key}, args...)
	}
	cmd := send(ctx, p, "evalsha", s.Hash(), key, args)
	if err := cmd.Err(); errors.Is(err, redis.ErrNoScript) || redis.HasErrorPrefix(err, "NOSCRIPT") {
		cmd = send(ctx, p, "eval", s.src, key, args)
	}
	return cmd
}

func send(ctx context.Context, p processor, name, payload, key string, args []any) *redis.Cmd {
	cmd := redis.NewCmd(ctx, append([]any{name, payload, 1, key}, args...)...)
	cmd.SetFirstKeyPos(3)
	_ = p.Process(ctx, onceCmd{cmd})
	return cmd
}

// Whether run may resend a script after an attempt that may have run it.
const (
	// resendable: a second run changes nothing the first one did (Claim
	// finds its own token, Complete a done record, Release a raised
	// fence), so one call takes effect once however often it is sent.
	resendable = true
	// sendOnce: a second run would take effect again (Extend would move
	// the lease a second time, from a later now), so run resends only
	// after attempts that surely did not run.
	sendOnce = false
)

// run sends s on key until an attempt gets the script's reply, at most
// 1 + b.retries times. lost is the error of the first attempt that may have
// run the script without its reply reaching us: when it is set, the reply
// of a later attempt comes from a resend, which may find the effect of the
// lost one. err is the last attempt's error when none got a reply.
//
// When lost is set, run appends resent to the arguments of every later
// attempt, so that the script can tell a resend from a first send.
func (b *Backend) run(ctx context.Context, s script, resend bool, resent []any, key string, args ...any) (reply *redis.Cmd, lost, err error) {
	for attempt := 0; ; attempt++ {
		a := args
		if lost != nil {
			a = append(args[:len(args):len(args)], resent...)
		}
		cmd := b.eval(ctx, s, b.prefix+key, a)
		err = cmd.Err()
		if err == nil {
			return cmd, lost, nil
		}
		if lost == nil && mayHaveRun(err) {
			lost = err
		}
		if attempt >= b.retries || !retryable(ctx, err) || (lost != nil && !resend) {
			if lost != nil && lost != err {
				err = fmt.Errorf("%w (after %w)", err, lost)
			}
			return nil, lost, err
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(attempt+1) * b.backoff):
		}
	}
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
	cmd, lost, err := b.run(ctx, claimScript, resendable, []any{"resend"}, key, millis(lease), millis(b.ttl), token)
	if err != nil {
		return store.Result{}, fmt.Errorf("redislock: claim %q (outcome unknown: the key may be held until its lease lapses): %w", key, err)
	}
	reply, err := cmd.Int64Slice()
	if err != nil || len(reply) != 3 {
		return store.Result{}, fmt.Errorf("redislock: claim %q: unexpected reply %v (%v)", key, cmd.Val(), err)
	}
	at := time.UnixMilli(reply[2])
	switch reply[0] {
	case 1:
		return store.Result{Outcome: store.Won, Claim: store.Claim{Key: key, Fence: reply[1], Token: token, LeaseExpiry: at}}, nil
	case 2:
		return store.Result{Outcome: store.AlreadyDone, Until: at}, nil
	case 3:
		return store.Result{Outcome: store.HeldByOther, Until: at}, nil
	case 4:
		// A resend, and the record is not this call's claim: the lost
		// attempt may have won the key before the key moved on (its lease
		// lapsed, and another caller reclaimed, completed or released it),
		// or may never have run. Not won would be a guess, and so would a
		// second win (one call, two fences).
		return store.Result{}, fmt.Errorf("redislock: claim %q (outcome unknown: an attempt whose reply was lost may have won the key, which is no longer this call's claim): %w", key, lost)
	}
	return store.Result{}, fmt.Errorf("redislock: claim %q: unexpected outcome %d", key, reply[0])
}

// Complete implements store.Backend.
func (b *Backend) Complete(ctx context.Context, c store.Claim) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	cmd, lost, err := b.run(ctx, completeScript, resendable, nil, c.Key, c.Fence, millis(b.ttl), c.Token)
	if err != nil {
		return false, fmt.Errorf("redislock: complete %q fence %d: %w", c.Key, c.Fence, err)
	}
	n, err := cmd.Int64()
	if err != nil {
		return false, fmt.Errorf("redislock: complete %q fence %d: unexpected reply: %w", c.Key, c.Fence, err)
	}
	if n == 1 {
		return true, nil
	}
	if lost != nil {
		// The record is not done with this claim now, but the lost attempt
		// may have completed it before it expired or was reclaimed.
		return false, fmt.Errorf("redislock: complete %q fence %d (outcome unknown: an attempt whose reply was lost may have completed the key, whose record has moved on): %w", c.Key, c.Fence, lost)
	}
	return false, nil
}

// Release implements store.Backend.
func (b *Backend) Release(ctx context.Context, c store.Claim) error {
	if err := store.ValidateKey(c.Key); err != nil {
		return err
	}
	// A resend that finds nothing to release is fine: either the lost
	// attempt released the claim, or the claim was no longer current.
	if _, _, err := b.run(ctx, releaseScript, resendable, nil, c.Key, c.Fence, millis(b.ttl), c.Token); err != nil {
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
	// Not resent once an attempt may have run: the caller (a heartbeat)
	// tries again at its next beat, as a call of its own.
	cmd, _, err := b.run(ctx, extendScript, sendOnce, nil, c.Key, c.Fence, millis(lease), millis(b.ttl), c.Token)
	if err != nil {
		return c, fmt.Errorf("redislock: extend %q fence %d: %w", c.Key, c.Fence, err)
	}
	ms, err := cmd.Int64()
	if err != nil {
		return c, fmt.Errorf("redislock: extend %q fence %d: unexpected reply: %w", c.Key, c.Fence, err)
	}
	if ms == 0 {
		return c, fmt.Errorf("redislock: extend %q fence %d: %w", c.Key, c.Fence, store.ErrLost)
	}
	c.LeaseExpiry = time.UnixMilli(ms)
	return c, nil
}

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

// String describes the backend, for logs.
func (b *Backend) String() string {
	return "redislock(prefix=" + strconv.Quote(b.prefix) + ", ttl=" + b.ttl.String() + ")"
}
