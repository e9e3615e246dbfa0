package pgxlock

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var _ store.Operator = (*Backend)(nil)

// record turns a row of key into a store.Record.
func record(key string, r row) store.Record {
	rec := store.Record{
		Key:         key,
		State:       store.State(r.state),
		Fence:       r.fence,
		LeaseExpiry: time.UnixMilli(r.lease),
		ExpiresAt:   time.UnixMilli(r.exp),
		Version:     store.VersionOf(r.token),
		Now:         time.UnixMilli(r.now),
	}
	if rec.State == store.Done {
		rec.Fingerprint = unstamp(r.fp, r.fence)
	}
	return rec
}

// Inspect implements store.Inspector: one read of the record, with the
// database's now.
func (b *Backend) Inspect(ctx context.Context, key string) (store.Record, bool, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Record{}, false, err
	}
	var r row
	var found bool
	err := b.retry(ctx, func() error {
		var err error
		r, found, err = b.read(ctx, b.db, []byte(key))
		return err
	})
	if err != nil {
		return store.Record{}, false, fmt.Errorf("pgxlock: inspect %q: %w", key, err)
	}
	if !found {
		return store.Record{}, false, nil
	}
	return record(key, r), true, nil
}

// ForceRelease implements store.ForceReleaser: it reads the record and,
// if it is still Claimed with r's fence and version, releases that claim
// as its holder's Release would (one conditional write on the token
// read).
func (b *Backend) ForceRelease(ctx context.Context, r store.Record) (bool, error) {
	if err := store.ValidateRecord(r); err != nil {
		return false, err
	}
	k := []byte(r.Key)
	var released bool
	err := b.retry(ctx, func() error {
		cur, ok, err := b.current(ctx, k, r, store.Claimed)
		if err != nil || !ok {
			released = false
			return err
		}
		tag, err := b.db.Exec(ctx, b.q.Release, k, cur.fence, millis(b.ttl), cur.token)
		released = err == nil && tag.RowsAffected() == 1
		return err
	})
	if err != nil {
		return false, fmt.Errorf("pgxlock: force-release %q fence %d: %w", r.Key, r.Fence, err)
	}
	return released, nil
}

// Forget implements store.Forgetter: it deletes the record if it is
// still Done with r's fence and version.
func (b *Backend) Forget(ctx context.Context, r store.Record) (bool, error) {
	if err := store.ValidateRecord(r); err != nil {
		return false, err
	}
	k := []byte(r.Key)
	var deleted bool
	err := b.retry(ctx, func() error {
		cur, ok, err := b.current(ctx, k, r, store.Done)
		if err != nil || !ok {
			deleted = false
			return err
		}
		tag, err := b.db.Exec(ctx, b.q.Forget, k, cur.fence, cur.token)
		deleted = err == nil && tag.RowsAffected() == 1
		return err
	})
	if err != nil {
		return false, fmt.Errorf("pgxlock: forget %q fence %d: %w", r.Key, r.Fence, err)
	}
	return deleted, nil
}

// current reads the record k and reports whether it is in state want with
// r's fence and version.
func (b *Backend) current(ctx context.Context, k []byte, r store.Record, want store.State) (row, bool, error) {
	cur, found, err := b.read(ctx, b.db, k)
	if err != nil || !found {
		return cur, false, err
	}
	ok := store.State(cur.state) == want && cur.fence == r.Fence && store.VersionOf(cur.token) == r.Version
	return cur, ok, nil
}

// List implements store.Lister: one statement per page, reading at most
// the page's limit of records of the key range in key order.
func (b *Backend) List(ctx context.Context, q store.ListQuery) (store.Page, error) {
	if err := store.ValidateQuery(q); err != nil {
		return store.Page{}, err
	}
	limit := q.Limit
	if limit == 0 {
		limit = store.DefaultListLimit
	}
	// Every valid key is at least "\x01".
	lower := []byte("\x01")
	if q.Prefix != "" {
		lower = []byte(q.Prefix)
	}
	if q.Cursor != "" {
		last, err := b.readCursor(q)
		if err != nil {
			return store.Page{}, err
		}
		lower = append(last, 0) // nothing lies between last and last+"\x00"
	}
	text, args := b.q.List, []any{lower, limit, int64(q.State)}
	if upper := successor([]byte(q.Prefix)); upper != nil {
		text, args = b.q.ListBelow, append(args, upper)
	}
	var page store.Page
	err := b.retry(ctx, func() error {
		var err error
		page, err = b.list(ctx, q, text, args, limit)
		return err
	})
	if err != nil {
		return store.Page{}, fmt.Errorf("pgxlock: list prefix %q: %w", q.Prefix, err)
	}
	return page, nil
}

func (b *Backend) list(ctx context.Context, q store.ListQuery, text string, args []any, limit int) (store.Page, error) {
	rows, err := b.db.Query(ctx, text, args...)
	if err != nil {
		return store.Page{}, err
	}
	defer rows.Close()
	var page store.Page
	var last []byte
	var read int64
	for rows.Next() {
		var key []byte
		var state, fence, lease, exp *int64
		var token, fp *string
		var now int64
		if err := rows.Scan(&last, &read, &key, &state, &fence, &lease, &exp, &token, &fp, &now); err != nil {
			return store.Page{}, err
		}
		if key == nil {
			continue // the window holds no record in the state
		}
		page.Records = append(page.Records, record(string(key), row{
			state: *state, fence: *fence, lease: *lease, exp: *exp, token: *token, fp: fp, now: now,
		}))
	}
	if err := rows.Err(); err != nil {
		return store.Page{}, err
	}
	if read >= int64(limit) && last != nil {
		page.Next = b.cursor(q, last)
	}
	return page, nil
}

// successor is the least byte string above every string with prefix, or
// nil when there is none (an empty prefix, or one of 0xff bytes only).
func successor(prefix []byte) []byte {
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

const cursorVersion = 1

// querySum binds a cursor to the table and the query it was issued for.
func (b *Backend) querySum(q store.ListQuery) []byte {
	sum := sha256.Sum256([]byte("pgx\x00" + b.table + "\x00" + strconv.Itoa(int(q.State)) + "\x00" + q.Prefix))
	return sum[:8]
}

func (b *Backend) cursor(q store.ListQuery, last []byte) string {
	c := append([]byte{cursorVersion}, b.querySum(q)...)
	return base64.RawURLEncoding.EncodeToString(append(c, last...))
}

func (b *Backend) readCursor(q store.ListQuery) ([]byte, error) {
	raw, err := base64.RawURLEncoding.DecodeString(q.Cursor)
	sum := b.querySum(q)
	if err != nil || len(raw) < 1+len(sum)+1 || raw[0] != cursorVersion || !bytes.Equal(raw[1:1+len(sum)], sum) {
		return nil, fmt.Errorf("%w: the cursor was not issued by this backend for prefix %q and state %v", store.ErrInvalidQuery, q.Prefix, q.State)
	}
	last := raw[1+len(sum):]
	if store.ValidateKey(string(last)) != nil || !strings.HasPrefix(string(last), q.Prefix) {
		return nil, fmt.Errorf("%w: the cursor holds a key outside prefix %q", store.ErrInvalidQuery, q.Prefix)
	}
	return last, nil
}
