package redislock

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The resends each operation may make unless WithRetries says otherwise,
// and the waits between attempts (see retry.Policy): 10 to 20ms before the
// first resend, doubling up to 0.5 to 1s.
const (
	defaultRetries = 2
	retryBase      = 20 * time.Millisecond
	retryMax       = time.Second
)

// retryable reports whether err left a script's outcome unknown in a way a
// resend may clear: a broken connection, or a server reply that refused the
// command before it ran; not any other reply, nor the caller's context
// ending (retry.Policy.Do stops on its own once ctx is done).
func retryable(err error) bool {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
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
// have the script. Both are one attempt.
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
// 1 + the policy's Retries times, waiting the policy's jittered backoff
// between attempts. lost is the error of the first attempt that may have
// run the script without its reply reaching us: when it is set, the reply
// of a later attempt comes from a resend, which may find the effect of the
// lost one. err is the last attempt's error when none got a reply; it
// wraps ctx.Err() when ctx ended first, and lost when that was another
// attempt's.
//
// When lost is set, run appends resent to the arguments of every later
// attempt, so that the script can tell a resend from a first send.
func (b *Backend) run(ctx context.Context, s script, resend bool, resent []any, key string, args ...any) (reply *redis.Cmd, lost, err error) {
	err = b.policy.Do(ctx, func(attempt int) error {
		if attempt > 0 && b.resending != nil {
			b.resending(attempt)
		}
		a := args
		if lost != nil {
			a = append(args[:len(args):len(args)], resent...)
		}
		reply = b.eval(ctx, s, b.prefix+key, a)
		err := reply.Err()
		if err != nil && lost == nil && mayHaveRun(err) {
			lost = err
		}
		return err
	}, func(err error) bool {
		return retryable(err) && (lost == nil || resend)
	})
	if err != nil {
		if lost != nil && !errors.Is(err, lost) {
			err = fmt.Errorf("%w (after %w)", err, lost)
		}
		return nil, lost, err
	}
	return reply, lost, nil
}
