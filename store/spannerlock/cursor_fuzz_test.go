package spannerlock

import (
	"bytes"
	"errors"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Any cursor string, forged, truncated or bit-flipped, decodes to a key
// under the query's prefix that store.ValidateKey accepts, or to an error
// wrapping store.ErrInvalidQuery: never a panic, never a key outside the
// prefix (from which the listing would read records outside it).
func FuzzDecodeCursor(f *testing.F) {
	b := &Backend{table: "IdempotencyKeys"}
	q := store.ListQuery{Prefix: "orders:", State: store.Done}
	f.Add(q.Prefix, int(q.State), b.encodeCursor(q, []byte("orders:1")))
	f.Add("", 0, b.encodeCursor(store.ListQuery{}, []byte("\xff")))
	f.Add("a", 1, "AQ")
	f.Fuzz(func(t *testing.T, prefix string, state int, cursor string) {
		q := store.ListQuery{Prefix: prefix, State: store.State(state), Cursor: cursor}
		last, err := b.decodeCursor(q)
		switch {
		case err != nil && !errors.Is(err, store.ErrInvalidQuery):
			t.Fatalf("cursor %q: %v, want ErrInvalidQuery", cursor, err)
		case err == nil && cursor != "" && (!bytes.HasPrefix(last, []byte(prefix)) || store.ValidateKey(string(last)) != nil):
			t.Fatalf("cursor %q read as key %q, outside prefix %q or invalid", cursor, last, prefix)
		}
	})
}
