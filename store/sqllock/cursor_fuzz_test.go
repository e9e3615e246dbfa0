package sqllock

import (
	"database/sql"
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
	db := sql.OpenDB(noConn{})
	defer db.Close()
	b, err := New(db, Postgres)
	if err != nil {
		f.Fatal(err)
	}
	q := store.ListQuery{Prefix: "orders:", State: store.Done}
	f.Add(q.Prefix, int(q.State), b.cursor(q, []byte("orders:1")))
	f.Add("", 0, b.cursor(store.ListQuery{}, []byte("\xff")))
	f.Add("a", 1, "AQ")
	f.Fuzz(func(t *testing.T, prefix string, state int, cursor string) {
		q := store.ListQuery{Prefix: prefix, State: store.State(state), Cursor: cursor}
		last, err := b.readCursor(q)
		switch {
		case err != nil && !errors.Is(err, store.ErrInvalidQuery):
			t.Fatalf("cursor %q: %v, want ErrInvalidQuery", cursor, err)
		case err == nil && (!strings.HasPrefix(string(last), prefix) || store.ValidateKey(string(last)) != nil):
			t.Fatalf("cursor %q read as key %q, outside prefix %q or invalid", cursor, last, prefix)
		}
	})
}
