package redislock

import (
	"errors"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Any cursor string, forged, truncated or bit-flipped, decodes to a cursor
// or to an error wrapping store.ErrInvalidQuery: never a panic, and a
// cursor the decoder accepts encodes back to one it reads alike.
func FuzzDecodeCursor(f *testing.F) {
	b := &Backend{prefix: DefaultPrefix}
	q := store.ListQuery{Prefix: "orders:", State: store.Done}
	f.Add(q.Prefix, int(q.State), b.encodeCursor(q, listCursor{}))
	f.Add(q.Prefix, int(q.State), b.encodeCursor(q, listCursor{node: "10.0.0.1:6379", scan: 1 << 40, seen: []uint64{1, 2, 3}}))
	f.Add("", 0, cursorTag)
	f.Add("a", 1, cursorTag+"AAAAAAAAAAA")
	f.Fuzz(func(t *testing.T, prefix string, state int, cursor string) {
		q := store.ListQuery{Prefix: prefix, State: store.State(state), Cursor: cursor}
		c, err := b.decodeCursor(q)
		if err != nil {
			if !errors.Is(err, store.ErrInvalidQuery) {
				t.Fatalf("cursor %q: %v, want ErrInvalidQuery", cursor, err)
			}
			return
		}
		if cursor == "" {
			return
		}
		q.Cursor = b.encodeCursor(q, c)
		again, err := b.decodeCursor(q)
		if err != nil || again.node != c.node || again.scan != c.scan || len(again.seen) != len(c.seen) {
			t.Fatalf("cursor %q read as %+v re-encodes to one read as %+v, %v", cursor, c, again, err)
		}
	})
}
