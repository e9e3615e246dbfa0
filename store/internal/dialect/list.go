package dialect

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Listing is how a backend lists one table in key order: the bounds of a
// query's key range, and its cursors, which are bound to the engine, the
// table and the query. sqllock's PostgreSQL dialect and pgxlock use the
// same Engine ("postgres"), so a cursor either issued on a table is
// accepted by the other.
type Listing struct {
	Engine, Table string
}

// Bounds returns the key range a page of q reads: from lower (the prefix,
// or just above the cursor's key) to below upper (nil: no upper bound).
// A cursor not issued by l for q's prefix and state is an error wrapping
// store.ErrInvalidQuery.
func (l Listing) Bounds(q store.ListQuery) (lower, upper []byte, err error) {
	// Every valid key is at least "\x01": a key is not empty and holds no
	// NUL byte.
	lower = []byte("\x01")
	if q.Prefix != "" {
		lower = []byte(q.Prefix)
	}
	if q.Cursor != "" {
		last, err := l.ReadCursor(q)
		if err != nil {
			return nil, nil, err
		}
		// No byte string lies between last and last+"\x00".
		lower = append(last, 0)
	}
	return lower, Successor([]byte(q.Prefix)), nil
}

// Successor is the least byte string above every string that starts with
// prefix: the prefix with its trailing 0xFF bytes dropped and its last
// byte raised; nil when there is none (an empty prefix, or 0xFF bytes
// only).
func Successor(prefix []byte) []byte {
	// Not bytes.TrimRight: its cutset is read as UTF-8, and "\xff" would
	// trim any invalid byte.
	end := len(prefix)
	for end > 0 && prefix[end-1] == 0xff {
		end--
	}
	if end == 0 {
		return nil
	}
	up := bytes.Clone(prefix[:end])
	up[end-1]++
	return up
}

// cursorVersion is the first byte of every cursor.
const cursorVersion = 1

// querySum binds a cursor to the engine, the table, the state and the
// prefix it was issued for.
func (l Listing) querySum(q store.ListQuery) []byte {
	sum := sha256.Sum256([]byte(l.Engine + "\x00" + l.Table + "\x00" + strconv.Itoa(int(q.State)) + "\x00" + q.Prefix))
	return sum[:8]
}

// Cursor is the cursor that continues q after the key last.
func (l Listing) Cursor(q store.ListQuery, last []byte) string {
	c := append([]byte{cursorVersion}, l.querySum(q)...)
	return base64.RawURLEncoding.EncodeToString(append(c, last...))
}

// ReadCursor returns the key q.Cursor continues after. A cursor of
// another format, or issued for another engine, table, prefix or state,
// or holding a key outside q's prefix, is an error wrapping
// store.ErrInvalidQuery.
func (l Listing) ReadCursor(q store.ListQuery) ([]byte, error) {
	raw, err := base64.RawURLEncoding.DecodeString(q.Cursor)
	sum := l.querySum(q)
	if err != nil || len(raw) < 1+len(sum)+1 || raw[0] != cursorVersion || !bytes.Equal(raw[1:1+len(sum)], sum) {
		return nil, fmt.Errorf("%w: the cursor was not issued by this backend for prefix %q and state %v", store.ErrInvalidQuery, q.Prefix, q.State)
	}
	last := raw[1+len(sum):]
	if store.ValidateKey(string(last)) != nil || !strings.HasPrefix(string(last), q.Prefix) {
		return nil, fmt.Errorf("%w: the cursor holds a key outside prefix %q", store.ErrInvalidQuery, q.Prefix)
	}
	return last, nil
}

// PurgeBatch is how many rows one purge statement deletes at most.
const PurgeBatch = 1000

// Purge runs del, which deletes at most n expired rows and returns how
// many it deleted, PurgeBatch rows at a time, until a batch falls short or
// limit rows are gone (limit <= 0: no limit). It returns the total, and
// del's first error.
func Purge(limit int, del func(n int) (int64, error)) (int, error) {
	total := 0
	for limit <= 0 || total < limit {
		n := PurgeBatch
		if limit > 0 && limit-total < n {
			n = limit - total
		}
		deleted, err := del(n)
		if err != nil {
			return total, err
		}
		total += int(deleted)
		if deleted < int64(n) {
			break
		}
	}
	return total, nil
}
