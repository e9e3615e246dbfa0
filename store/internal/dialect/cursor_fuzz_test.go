package dialect

import (
	"errors"
	"strings"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Any cursor string, forged, truncated or bit-flipped, reads as a key
// under the query's prefix that store.ValidateKey accepts, or as an error
// wrapping store.ErrInvalidQuery: never a panic, never a key outside the
// prefix.
func FuzzReadCursor(f *testing.F) {
	b := Listing{Engine: "postgres", Table: "idempotency_keys"}
	q := store.ListQuery{Prefix: "orders:", State: store.Done}
	f.Add(q.Prefix, int(q.State), b.Cursor(q, []byte("orders:1")))
	f.Add("", 0, b.Cursor(store.ListQuery{}, []byte("\xff")))
	f.Add("a", 1, "AQ")
	f.Fuzz(func(t *testing.T, prefix string, state int, cursor string) {
		q := store.ListQuery{Prefix: prefix, State: store.State(state), Cursor: cursor}
		last, err := b.ReadCursor(q)
		switch {
		case err != nil && !errors.Is(err, store.ErrInvalidQuery):
			t.Fatalf("cursor %q: %v, want ErrInvalidQuery", cursor, err)
		case err == nil && (!strings.HasPrefix(string(last), prefix) || store.ValidateKey(string(last)) != nil):
			t.Fatalf("cursor %q read as key %q, outside prefix %q or invalid", cursor, last, prefix)
		}
	})
}
