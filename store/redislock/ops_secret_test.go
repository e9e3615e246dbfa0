package redislock_test

import (
	"strings"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A record that Inspect or List cannot make sense of (here a hash of the
// earlier format whose state is neither claimed nor done) is an error
// that does not quote its token: an operator's error message or idemctl's
// --json output must not hand out what completes a claim. On main the
// error was "unexpected reply [...]" with the whole reply, token included.
func TestAnUnreadableRecordsErrorHoldsNoToken(t *testing.T) {
	const token = "0123456789abcdef0123456789abcdef"
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	raw := prefixOf(b) + "odd"
	if err := c.HSet(t.Context(), raw, "s", "x", "f", "1", "l", "1", "t", token).Err(); err != nil {
		t.Fatal(err)
	}
	_, _, err := b.Inspect(t.Context(), "odd")
	if err == nil {
		t.Fatal("Inspect of a record in state x: no error")
	}
	if strings.Contains(err.Error(), token) {
		t.Errorf("Inspect's error quotes the token: %v", err)
	}
	_, err = b.List(t.Context(), store.ListQuery{Prefix: "odd"})
	if err == nil {
		t.Fatal("List over a record in state x: no error")
	}
	if strings.Contains(err.Error(), token) {
		t.Errorf("List's error quotes the token: %v", err)
	}
}
