// Package redislock is a [store.Backend] on Redis (or Memorystore), through
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
// A record is one string under prefix+key: "c<fence>,<lease expiry>,<token>"
// while claimed (the lease expiry in Unix ms by the server's clock, the
// key set to expire at lease expiry + ttl with SET ... PXAT), and
// "d<fence>,,<token>[,<fingerprint>]" once done (the key set to expire ttl
// after the completion with SET ... PX: that expiry is the record's
// expires-at), with the winning claim's token and the payload fingerprint
// given to [Backend.CompleteFingerprint]. Redis deletes a record exactly
// when the contract allows and not before. Records of the earlier format (a hash with fields
// s, f, l, e, t) are still read, so an upgrade keeps live keys; the next
// write replaces one with the string form. An instance of the earlier
// version fails (an error, so the delivery is nacked and redelivered) on a
// record the new format wrote: during a rolling upgrade, redeliveries
// settle on upgraded instances, and no key runs twice. A Redis that loses
// writes on restart (no AOF, no replica) loses records with them: a
// delivery in flight may then run twice. So does a failover to a replica
// that had not yet received the latest writes (replication is
// asynchronous; Memorystore's standard tier fails over this way). The
// scripts need Redis 7.0 or later (SET ... NX GET, PEXPIRETIME).
//
// Complete, Release and Extend act on a record only when both its fence
// and its token are the claim's: the fence decides, as the port says, and
// the token tells apart a record that Redis deleted at its expires-at and
// another caller created afresh, whose fence restarted at 1.
//
// Redis may delete a record early on its own when memory is short: a
// server with a maxmemory limit must use maxmemory-policy noeviction (every
// record has an expiry, so the volatile-* policies evict records too).
// [Backend.CheckEviction] tells; call it at start-up.
//
// After a network error that may have come after the server ran a script
// (a lost reply), the backend resends it itself (see [WithRetries]) and
// reads the resend's reply for what it can prove; go-redis's own resends
// are turned off for these scripts.
package redislock

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/retry"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var (
	//go:embed record.lua
	recordLua string
	//go:embed claim_fresh.lua
	claimFreshLua string
	//go:embed claim.lua
	claimLua string
	//go:embed complete_fast.lua
	completeFastLua string
	//go:embed complete.lua
	completeLua string
	//go:embed release.lua
	releaseLua string
	//go:embed extend.lua
	extendLua string

	// Claim's and Complete's common paths come before record.lua: they
	// return before Redis builds its functions.
	claimScript    = newScript(claimFreshLua + recordLua + claimLua)
	completeScript = newScript(completeFastLua + recordLua + completeLua)
	releaseScript  = newScript(recordLua + releaseLua)
	extendScript   = newScript(recordLua + extendLua)
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
// a claimed record outlives its lease. Default [store.DefaultTTL]. Any
// positive ttl is honoured, rounded up to a whole millisecond, and so is
// any positive lease: the scripts count Unix milliseconds, exact in Lua's
// numbers up to 2^53 (about 285,000 years), so math.MaxInt64 for both (a
// key that expires about 584 years from now) is neither capped nor
// refused.
func WithTTL(ttl time.Duration) Option {
	return func(b *Backend) { b.ttl = ttl }
}

// WithRetries sets how many times each of Claim, Complete, Release and
// Extend may resend its script after the first attempt failed: n = 0 sends
// once. Default 2; New refuses a negative n. It does not cover
// CheckEviction, whose INFO the client sends and resends as its own
// options say.
//
// An attempt is resent only when it failed with a network error (a refused
// dial, a broken connection, a reply that did not arrive in time, no pooled
// connection) or with a server reply that turned the command away before it
// ran (LOADING, TRYAGAIN, CLUSTERDOWN, MASTERDOWN, READONLY). Any other
// reply is the outcome and is never resent, and nothing is resent once ctx
// has ended: the operation then returns an error that wraps ctx.Err()
// (and the failed attempt's error when ctx ended while the backend waited
// to resend). Between attempts the backend waits a jittered
// backoff (10 to 20ms before the first resend, doubling up to 1s) that
// ends early with ctx. A script the server does not have yet (NOSCRIPT,
// then EVAL) is part of one attempt, not a resend.
//
// A network error other than a failed dial, a failed write or a pool
// timeout may have come after the server ran the script (a lost reply). Claim, Complete and Release are then still resent, with the same
// arguments (Claim's marked as a resend), and each reads the resend's reply
// for what it can prove. Extend is not: a resend would move the lease a
// second time, so it returns the error and the caller (a heartbeat) tries
// again at its next beat.
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
// for the same reason. A resent Release that finds nothing to release
// returns nil: the lost attempt released the claim, or the claim was no
// longer current. Clients that do not implement Process (none of
// go-redis's) run the scripts through redis.Script.Run, and go-redis may
// resend them unseen.
func WithRetries(n int) Option {
	return func(b *Backend) { b.policy.Retries = n }
}

// Backend is a [store.Backend], [store.Extender] and [store.Fingerprinter]
// on Redis. It is safe for
// concurrent use.
type Backend struct {
	client redis.Scripter
	prefix string
	ttl    time.Duration
	policy retry.Policy // the resends of each operation (WithRetries)

	// resending, when set (only by tests: export_test.go), is called
	// before each resend, after the wait: a test acts there on the
	// server between a lost reply and the resend.
	resending func(attempt int)
}

var (
	_ store.Backend       = (*Backend)(nil)
	_ store.Extender      = (*Backend)(nil)
	_ store.Fingerprinter = (*Backend)(nil)
)

// New returns a Backend over client: a *redis.Client, *redis.ClusterClient,
// a failover client or any redis.UniversalClient but a *redis.Ring. It does
// no I/O. It fails on a nil client, a *redis.Ring, a non-positive ttl, a
// prefix longer than [store.MaxKeyLen], or negative retries.
//
// A Ring is refused because it picks a key's shard by hashing over the
// shards it sees at the moment: when a shard is added or removed, or its
// heartbeat finds one down, keys move to a shard that has no record of
// them, so a live claim goes unseen (a second caller wins the key beside
// its holder) and a done key runs again within its ttl. Redis Cluster
// keeps one owner per key through resharding and failover.
func New(client redis.Scripter, opts ...Option) (*Backend, error) {
	b := &Backend{
		client: client,
		prefix: DefaultPrefix,
		ttl:    store.DefaultTTL,
		policy: retry.Policy{Retries: defaultRetries, Base: retryBase, Max: retryMax},
	}
	for _, o := range opts {
		o(b)
	}
	if client == nil {
		return nil, errors.New("redislock: nil client")
	}
	if _, ok := client.(*redis.Ring); ok {
		return nil, errors.New("redislock: a *redis.Ring moves keys between shards when its shards change, so a record can go unseen and a key be won twice: use a *redis.ClusterClient or one server")
	}
	if err := store.ValidateTTL(b.ttl); err != nil {
		return nil, fmt.Errorf("redislock: %w", err)
	}
	if len(b.prefix) > store.MaxKeyLen {
		return nil, fmt.Errorf("redislock: prefix of %d bytes is longer than %d", len(b.prefix), store.MaxKeyLen)
	}
	if b.policy.Retries < 0 {
		return nil, fmt.Errorf("redislock: retries %d is negative", b.policy.Retries)
	}
	return b, nil
}

// TTL returns the ttl the backend applies.
func (b *Backend) TTL() time.Duration { return b.ttl }

// millis is d in whole milliseconds, rounded up, without overflow
// (store.CeilUnits): a duration within a millisecond of the largest one (a
// lease or ttl of math.MaxInt64 meaning "forever") must not wrap to a
// negative count, which would set a record's expiry in the past.
func millis(d time.Duration) int64 { return store.CeilUnits(d, time.Millisecond) }

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
	reply, fp, err := claimReply(cmd)
	if err != nil {
		return store.Result{}, fmt.Errorf("redislock: claim %q: %w", key, err)
	}
	at := time.UnixMilli(reply[2])
	switch reply[0] {
	case 1:
		return store.Result{Outcome: store.Won, Claim: store.Claim{Key: key, Fence: reply[1], Token: token, LeaseExpiry: at}}, nil
	case 2:
		if reply[2] < 0 { // a done key without an expiry: done for good
			at = time.Time{}
		}
		return store.Result{Outcome: store.AlreadyDone, Until: at, Fingerprint: fp}, nil
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

// claimReply reads claim.lua's reply: outcome, fence and instant, and the
// fingerprint that follows them for AlreadyDone. A fresh key's win is one
// integer, the lease expiry (outcome 1, fence 1).
func claimReply(cmd *redis.Cmd) (reply [3]int64, fp string, err error) {
	if lease, ok := cmd.Val().(int64); ok {
		return [3]int64{1, 1, lease}, "", nil
	}
	v, err := cmd.Slice()
	if err != nil || len(v) < 3 || len(v) > 4 {
		return reply, "", fmt.Errorf("unexpected reply %v (%v)", cmd.Val(), err)
	}
	for i := range reply {
		n, ok := v[i].(int64)
		if !ok {
			return reply, "", fmt.Errorf("unexpected reply %v", v)
		}
		reply[i] = n
	}
	if len(v) == 4 {
		var ok bool
		if fp, ok = v[3].(string); !ok {
			return reply, "", fmt.Errorf("unexpected reply %v", v)
		}
	}
	return reply, fp, nil
}

// Complete implements store.Backend. It stores no fingerprint (and so
// clears none: a record won by a Claim never carries one).
func (b *Backend) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return b.complete(ctx, c, "")
}

// CompleteFingerprint implements store.Fingerprinter: Complete that also
// keeps fp in the done record, within the record's one value (the key
// grows by len(fp) + 1 bytes), for Claim to report in
// [store.Result.Fingerprint]. Records written without one, and records of
// the earlier hash format, report none.
func (b *Backend) CompleteFingerprint(ctx context.Context, c store.Claim, fp string) (bool, error) {
	if err := store.ValidateFingerprint(fp); err != nil {
		return false, err
	}
	return b.complete(ctx, c, fp)
}

func (b *Backend) complete(ctx context.Context, c store.Claim, fp string) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	if c.Fence < 1 || strings.IndexByte(c.Token, ',') >= 0 {
		// No record has such a fence or token (Claim's tokens are hex,
		// and the format separates its fields with commas), so the claim
		// is stale. complete.lua could not tell either from the done value
		// it reads them from: its pattern takes no sign, and a token ends
		// at its first comma (the rest would be a fingerprint).
		return false, nil
	}
	cmd, lost, err := b.run(ctx, completeScript, resendable, nil, c.Key, claimedValue(c), millis(b.ttl), doneValue(c, fp))
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

// claimedValue is the record c's claim wrote (or its last Extend rewrote):
// complete.lua settles a record equal to it without decoding it. A claim
// whose record has moved on (or one not made by this backend) does not
// match it, and the script decodes the record instead.
func claimedValue(c store.Claim) string {
	b := make([]byte, 0, 48+len(c.Token))
	b = append(b, 'c')
	b = strconv.AppendInt(b, c.Fence, 10)
	b = append(b, ',')
	b = strconv.AppendInt(b, c.LeaseExpiry.UnixMilli(), 10)
	b = append(b, ',')
	b = append(b, c.Token...)
	return string(b)
}

// doneValue is the done record completing c, with fingerprint fp (none
// when empty).
func doneValue(c store.Claim, fp string) string {
	b := make([]byte, 0, 24+len(c.Token)+len(fp))
	b = append(b, 'd')
	b = strconv.AppendInt(b, c.Fence, 10)
	b = append(b, ',', ',')
	b = append(b, c.Token...)
	if fp != "" {
		b = append(b, ',')
		b = append(b, fp...)
	}
	return string(b)
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

// String describes the backend, for logs.
func (b *Backend) String() string {
	return "redislock(prefix=" + strconv.Quote(b.prefix) + ", ttl=" + b.ttl.String() + ")"
}
