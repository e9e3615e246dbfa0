package pgxlock

import (
	"context"
	"fmt"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/internal/dialect"
)

var _ store.Operator = (*Backend)(nil)

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
	return r.Record(key), true, nil
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
	err := b.retry(ctx, func() (err error) {
		released, err = dialect.Conditional(b.reader(ctx, k), r, store.Claimed, func(cur row) (int64, error) {
			tag, err := b.db.Exec(ctx, b.q.Release, k, cur.Fence, millis(b.ttl), cur.Token)
			return tag.RowsAffected(), err
		})
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
	err := b.retry(ctx, func() (err error) {
		deleted, err = dialect.Conditional(b.reader(ctx, k), r, store.Done, func(cur row) (int64, error) {
			tag, err := b.db.Exec(ctx, b.q.Forget, k, cur.Fence, cur.Token)
			return tag.RowsAffected(), err
		})
		return err
	})
	if err != nil {
		return false, fmt.Errorf("pgxlock: forget %q fence %d: %w", r.Key, r.Fence, err)
	}
	return deleted, nil
}

// reader returns a read of the record k on the backend's DB.
func (b *Backend) reader(ctx context.Context, k []byte) func() (row, bool, error) {
	return func() (row, bool, error) { return b.read(ctx, b.db, k) }
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
	lower, upper, err := b.listing().Bounds(q)
	if err != nil {
		return store.Page{}, err
	}
	text, args := b.q.List, []any{lower, limit, int64(q.State)}
	if upper != nil {
		text, args = b.q.ListBelow, append(args, upper)
	}
	var page store.Page
	err = b.retry(ctx, func() error {
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
		page.Records = append(page.Records, row{
			State: *state, Fence: *fence, Lease: *lease, Exp: *exp, Token: *token, FP: fp, Now: now,
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

// listing is the backend's listing of its table: sqllock's PostgreSQL
// dialect's, so that a cursor either backend issued on the table is
// accepted by the other.
func (b *Backend) listing() dialect.Listing {
	return dialect.Listing{Engine: dialect.Postgres().Name, Table: b.table}
}
