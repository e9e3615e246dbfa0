package redislock

import "github.com/gcp-pubsub-idempotency/idempotency/store"

// OnResend has b call f before each resend (attempt 1, 2, ...), after the
// backoff: a test acts there on the server between a lost reply and the
// resend, in step with the backend rather than racing its wait.
func OnResend(b *Backend, f func(attempt int)) { b.resending = f }

// ClaimLua is claim.lua's source, for tests that run it inside a MULTI
// beside a script that sets the instant it judges.
var ClaimLua = claimFreshLua + recordLua + claimLua

// SeenInCursor is how many keys of a SCAN reply the cursor next (issued by
// b for q) carries as already taken: more than 0 when List cut a SCAN
// reply between two pages. -1 for a cursor b refuses.
func SeenInCursor(b *Backend, q store.ListQuery, next string) int {
	q.Cursor = next
	c, err := b.decodeCursor(q)
	if err != nil {
		return -1
	}
	return len(c.seen)
}
