package redislock

import "time"

// SetRetryBackoff sets how long b waits before its first resend, so a test
// can act on the server between a lost reply and the retry.
func SetRetryBackoff(b *Backend, d time.Duration) { b.backoff = d }

// The scripts' sources, for tests that run them inside a MULTI beside a
// script that sets the instant they judge.
var (
	ClaimLua    = claimLua
	CompleteLua = completeLua
)
