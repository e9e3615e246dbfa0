package redislock

// OnResend has b call f before each resend (attempt 1, 2, ...), after the
// backoff: a test acts there on the server between a lost reply and the
// resend, in step with the backend rather than racing its wait.
func OnResend(b *Backend, f func(attempt int)) { b.resending = f }

// ClaimLua is claim.lua's source, for tests that run it inside a MULTI
// beside a script that sets the instant it judges.
var ClaimLua = claimFreshLua + recordLua + claimLua
