package sqllock

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/internal/dialect"
)

var _ store.Operator = (*Backend)(nil)

// Inspect implements store.Inspector: one SELECT of the key's row by its
// primary key, with the database's now read in the same statement, by the
// expression Claim judges leases with (for SQLite, the process's clock).
// It changes nothing: an expired record is reported as stored.
func (b *Backend) Inspect(ctx context.Context, key string) (store.Record, bool, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Record{}, false, err
	}
	var r row
	var found bool
	err := b.retry(ctx, func() error {
		var err error
		r, found, err = b.read(ctx, []byte(key))
		return err
	})
	if err != nil {
		return store.Record{}, false, fmt.Errorf("sqllock: inspect %q: %w", key, err)
	}
	if !found {
		return store.Record{}, false, nil
	}
	return r.Record(key), true, nil
}

// ForceRelease implements store.ForceReleaser. SQL cannot compute the
// record's version from its token on every engine, so it reads the row
// (its token, fence and state), checks them against r, and then runs
// Release's own UPDATE on the token it read: one conditional statement
// (key, fence, token, state Claimed) that sets the lease expiry to the
// database's now and raises the fence, as the holder's Release would. A
// record that changed between the read and the write is left alone, and
// the call returns false.
func (b *Backend) ForceRelease(ctx context.Context, r store.Record) (bool, error) {
	if err := store.ValidateRecord(r); err != nil {
		return false, err
	}
	k := []byte(r.Key)
	var released bool
	err := b.retry(ctx, func() (err error) {
		released, err = dialect.Conditional(b.reader(ctx, k), r, store.Claimed, func(cur row) (int64, error) {
			if b.q.Returning {
				return b.exec(ctx, b.q.Release, k, cur.Fence, millis(b.ttl), cur.Token)
			}
			return b.exec(ctx, b.q.Release, millis(b.ttl), k, cur.Fence, cur.Token)
		})
		return err
	})
	if err != nil {
		return false, fmt.Errorf("sqllock: force-release %q fence %d: %w", r.Key, r.Fence, err)
	}
	return released, nil
}

// Forget implements store.Forgetter: it reads the row as ForceRelease
// does, then deletes it with one conditional DELETE (key, fence, token,
// state Done) on the token it read. A Claimed record is never deleted.
func (b *Backend) Forget(ctx context.Context, r store.Record) (bool, error) {
	if err := store.ValidateRecord(r); err != nil {
		return false, err
	}
	k := []byte(r.Key)
	var deleted bool
	err := b.retry(ctx, func() (err error) {
		deleted, err = dialect.Conditional(b.reader(ctx, k), r, store.Done, func(cur row) (int64, error) {
			return b.exec(ctx, b.q.Forget, k, cur.Fence, cur.Token)
		})
		return err
	})
	if err != nil {
		return false, fmt.Errorf("sqllock: forget %q fence %d: %w", r.Key, r.Fence, err)
	}
	return deleted, nil
}

// reader returns a read of the row of k.
func (b *Backend) reader(ctx context.Context, k []byte) func() (row, bool, error) {
	return func() (row, bool, error) { return b.read(ctx, k) }
}

// List implements store.Lister with one SELECT per call, which reads at
// most q.Limit records (DefaultListLimit when zero): the next ones, in
// key order, of the prefix's key range on the table's primary key, from
// the cursor on. The state filter applies to those records, so a page
// with a state set may be short, even empty, while Next is set. Keys are
// compared as bytes (the key column is binary on every engine), so the
// prefix is matched byte for byte, with no pattern or collation: '%', '_'
// and '\' are plain bytes. Next is set when the call read a full window;
// the last page may then be empty.
//
// Each record is reported once. The cursor holds the last key the call
// read and a digest of the table, the prefix and the state; List refuses,
// with store.ErrInvalidQuery, one issued for another table or query.
func (b *Backend) List(ctx context.Context, q store.ListQuery) (store.Page, error) {
	if err := store.ValidateQuery(q); err != nil {
		return store.Page{}, err
	}
	limit := q.Limit
	if limit == 0 {
		limit = store.DefaultListLimit
	}
	lower, upper, err := b.listing().Bounds(q)
	if err != nil {
		return store.Page{}, err
	}
	state := int64(q.State)
	var text string
	var args []any
	switch {
	case upper == nil:
		text = b.q.List
		if b.q.Returning {
			args = []any{lower, limit, state}
		} else {
			args = []any{lower, limit, state, state}
		}
	case b.q.Returning:
		text, args = b.q.ListBelow, []any{lower, limit, state, upper}
	default:
		text, args = b.q.ListBelow, []any{lower, upper, limit, state, state}
	}
	var page store.Page
	err = b.retry(ctx, func() error {
		var err error
		page, err = b.list(ctx, q, text, args, limit)
		return err
	})
	if err != nil {
		return store.Page{}, fmt.Errorf("sqllock: list prefix %q: %w", q.Prefix, err)
	}
	return page, nil
}

// list runs one List statement.
func (b *Backend) list(ctx context.Context, q store.ListQuery, text string, args []any, limit int) (store.Page, error) {
	st, err := b.stmt(ctx, text)
	if err != nil {
		return store.Page{}, err
	}
	rows, err := st.QueryContext(ctx, args...)
	if err != nil {
		return store.Page{}, err
	}
	defer rows.Close()
	var page store.Page
	var last []byte
	var read int64
	for rows.Next() {
		var key []byte
		var state, fence, lease, exp sql.NullInt64
		var token sql.NullString
		var fp *string
		var now int64
		if err := rows.Scan(&last, &read, &key, &state, &fence, &lease, &exp, &token, &fp, &now); err != nil {
			return store.Page{}, err
		}
		if key == nil {
			continue // the window holds no record in the state
		}
		page.Records = append(page.Records, row{
			State: state.Int64, Fence: fence.Int64, Lease: lease.Int64, Exp: exp.Int64,
			Token: token.String, FP: fp, Now: now,
		}.Record(string(key)))
	}
	if err := rows.Err(); err != nil {
		return store.Page{}, err
	}
	if read >= int64(limit) && last != nil {
		page.Next = b.listing().Cursor(q, last)
	}
	return page, nil
}

// listing is the backend's listing of its table (its cursors name the
// dialect and the table).
func (b *Backend) listing() dialect.Listing {
	return dialect.Listing{Engine: b.d.String(), Table: b.table}
}
