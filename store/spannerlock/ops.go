package spannerlock

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"time"

	"cloud.google.com/go/spanner"
	"google.golang.org/api/iterator"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var _ store.Operator = (*Backend)(nil)

// versionSQL is store.VersionOf(token) in Spanner's SQL: the first 16 hex
// digits of the SHA-256 digest of the token's bytes, lower case.
const versionSQL = "SUBSTR(TO_HEX(SHA256(token)), 1, 16)"

// recordColumns are the columns a Record is made of, as Inspect and List
// read them.
const recordColumns = "key, state, fence, lease_expiry, expires_at, token, fingerprint"

// Inspect returns key's record as stored, read by a single-use strong
// read-only query that reads CURRENT_TIMESTAMP() with the row (1 RPC);
// Record.Now is that instant, the clock Claim judges by. It locks and
// changes nothing, and reports an expired row as stored, until Spanner's
// row deletion policy (or PurgeExpired) deletes it. A failed query is
// run again as any call's ([WithRetries]).
func (b *Backend) Inspect(ctx context.Context, key string) (store.Record, bool, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Record{}, false, err
	}
	stmt := spanner.Statement{
		SQL: "SELECT CURRENT_TIMESTAMP(), r.key, r.state, r.fence, r.lease_expiry, r.expires_at, r.token, r.fingerprint " +
			"FROM UNNEST([1]) AS one LEFT JOIN " + b.table + " AS r ON r.key = @key",
		Params: map[string]any{"key": []byte(key)},
	}
	var (
		rec   store.Record
		found bool
	)
	err := b.query(ctx, stmt, func(r *spanner.Row) error {
		var err error
		rec, found, err = record(r)
		return err
	})
	if err == nil && rec.Now.IsZero() {
		err = errors.New("the query returned no row")
	}
	if err != nil {
		return store.Record{}, false, fmt.Errorf("spannerlock: inspect %q: %w", key, err)
	}
	if !found {
		return store.Record{}, false, nil
	}
	return rec, true, nil
}

// record decodes a row of CURRENT_TIMESTAMP() followed by recordColumns
// (NULL when there is no row) into a Record, with false for NULLs.
func record(r *spanner.Row) (store.Record, bool, error) {
	var (
		now          time.Time
		key          []byte
		state, fence spanner.NullInt64
		lease, exp   spanner.NullTime
		token, fp    spanner.NullString
	)
	if err := r.Columns(&now, &key, &state, &fence, &lease, &exp, &token, &fp); err != nil {
		return store.Record{}, false, err
	}
	if !state.Valid {
		return store.Record{Now: now}, false, nil
	}
	rec := store.Record{
		Key:         string(key),
		Fence:       fence.Int64,
		LeaseExpiry: lease.Time,
		ExpiresAt:   exp.Time,
		Fingerprint: fp.StringVal,
		Version:     store.VersionOf(token.StringVal),
		Now:         now,
	}
	switch state.Int64 {
	case stateClaimed:
		rec.State = store.Claimed
	case stateDone:
		rec.State = store.Done
	}
	if rec.State == 0 || rec.Fence < 1 {
		return store.Record{}, false, fmt.Errorf("the row of %q is not a record of this backend (state %d, fence %d)", key, state.Int64, fence.Int64)
	}
	return rec, true, nil
}

// query runs stmt in a single-use strong read-only transaction, calling
// each for every row, and runs it again as any call's after a retryable
// failure.
func (b *Backend) query(ctx context.Context, stmt spanner.Statement, each func(*spanner.Row) error) error {
	return b.policy.Do(ctx, func(int) error {
		it := b.client.Single().Query(ctx, stmt)
		defer it.Stop()
		for {
			r, err := it.Next()
			if err == iterator.Done {
				return nil
			}
			if err != nil {
				return err
			}
			if err := each(r); err != nil {
				return err
			}
		}
	}, retryable)
}

// ListScan is how many rows in key order one call of [Backend.List]
// with a state filter reads at most (a call without one reads at most
// the page's limit).
const ListScan = store.MaxListLimit

// List returns one page of the records under q.Prefix, in key order (the
// order of the key's bytes), in one single-use strong read-only query (1
// RPC) that reads CURRENT_TIMESTAMP() with the rows; each record's Now is
// that instant. It locks and changes nothing.
//
// The query reads the primary key's range of the prefix from the cursor
// on, in key order, and a call reads a bounded number of rows: without a
// state filter, at most the page's limit (q.Limit, or
// store.DefaultListLimit when zero); with one, at most [ListScan] rows,
// of which it returns those in q.State, at most the limit. A page of a
// state that few rows are in may thus be short, even empty, while Next
// is set. (Beside the page the query reports how many rows it read and
// the last one's key, so its plan may read those rows more than once.)
// Every record that exists under the prefix in the selected state for
// the whole listing appears once.
//
// Next is the last key the page read, encoded with a digest of the
// table, prefix and state: a cursor of another query (or backend table)
// is refused with an error wrapping store.ErrInvalidQuery, before any
// I/O.
func (b *Backend) List(ctx context.Context, q store.ListQuery) (store.Page, error) {
	if err := store.ValidateQuery(q); err != nil {
		return store.Page{}, err
	}
	after, err := b.decodeCursor(q)
	if err != nil {
		return store.Page{}, err
	}
	limit := q.Limit
	if limit == 0 {
		limit = store.DefaultListLimit
	}
	scan := limit
	if q.State != 0 {
		scan = max(limit, ListScan)
	}
	var state int64
	switch q.State {
	case store.Claimed:
		state = stateClaimed
	case store.Done:
		state = stateDone
	}
	p := map[string]any{"start": []byte(q.Prefix), "scan": int64(scan), "limit": int64(limit), "state": state}
	where := "key >= @start"
	if after != nil {
		where, p["start"] = "key > @start", after
	}
	if end := prefixEnd([]byte(q.Prefix)); end != nil {
		where += " AND key < @end"
		p["end"] = end
	}
	// The scanned rows in one subquery; the page is those in the state,
	// with the scan's last key and size, so that a page short of the
	// limit still moves the cursor past what it read.
	stmt := spanner.Statement{
		SQL: "WITH scan AS (SELECT " + recordColumns + " FROM " + b.table + " WHERE " + where + " ORDER BY key LIMIT @scan) " +
			"SELECT CURRENT_TIMESTAMP(), (SELECT COUNT(*) FROM scan), (SELECT MAX(key) FROM scan), " +
			"ARRAY(SELECT AS STRUCT " + recordColumns + " FROM scan WHERE @state = 0 OR state = @state ORDER BY key LIMIT @limit)",
		Params: p,
	}
	var (
		now     time.Time
		scanned int64
		last    []byte
		rows    []*listRow
	)
	err = b.query(ctx, stmt, func(r *spanner.Row) error {
		return r.Columns(&now, &scanned, &last, &rows)
	})
	if err == nil && now.IsZero() {
		err = errors.New("the query returned no row")
	}
	if err != nil {
		return store.Page{}, fmt.Errorf("spannerlock: list %q: %w", q.Prefix, err)
	}
	page := store.Page{Records: make([]store.Record, 0, len(rows))}
	for _, lr := range rows {
		rec, err := lr.record(now)
		if err != nil {
			return store.Page{}, fmt.Errorf("spannerlock: list %q: %w", q.Prefix, err)
		}
		page.Records = append(page.Records, rec)
	}
	switch {
	case len(rows) == limit:
		// The page is full: go on after its last record, which may be
		// before the end of the scan.
		page.Next = b.encodeCursor(q, []byte(page.Records[len(rows)-1].Key))
	case scanned == int64(scan):
		// Every row in the state that the scan read is in the page, and
		// the range may go on.
		page.Next = b.encodeCursor(q, last)
	}
	return page, nil
}

// listRow is a row of List's array of records.
type listRow struct {
	Key         []byte             `spanner:"key"`
	State       int64              `spanner:"state"`
	Fence       int64              `spanner:"fence"`
	LeaseExpiry time.Time          `spanner:"lease_expiry"`
	ExpiresAt   time.Time          `spanner:"expires_at"`
	Token       string             `spanner:"token"`
	Fingerprint spanner.NullString `spanner:"fingerprint"`
}

func (lr *listRow) record(now time.Time) (store.Record, error) {
	rec := store.Record{
		Key:         string(lr.Key),
		Fence:       lr.Fence,
		LeaseExpiry: lr.LeaseExpiry,
		ExpiresAt:   lr.ExpiresAt,
		Fingerprint: lr.Fingerprint.StringVal,
		Version:     store.VersionOf(lr.Token),
		Now:         now,
	}
	switch lr.State {
	case stateClaimed:
		rec.State = store.Claimed
	case stateDone:
		rec.State = store.Done
	}
	if rec.State == 0 || rec.Fence < 1 {
		return store.Record{}, fmt.Errorf("the row of %q is not a record of this backend (state %d, fence %d)", lr.Key, lr.State, lr.Fence)
	}
	return rec, nil
}

// prefixEnd returns the least byte string above every string that starts
// with prefix, or nil when there is none (an empty prefix, or one of
// 0xFF bytes only).
func prefixEnd(prefix []byte) []byte {
	end := bytes.Clone(prefix)
	for i := len(end) - 1; i >= 0; i-- {
		if end[i] < 0xFF {
			end[i]++
			return end[:i+1]
		}
	}
	return nil
}

// cursorVersion is the first byte of a cursor, the format's.
const cursorVersion = 1

// queryTag digests what a cursor is valid for: the table, prefix and
// state of the query that issued it.
func (b *Backend) queryTag(q store.ListQuery) []byte {
	h := sha256.New()
	fmt.Fprintf(h, "spannerlock\x00%s\x00%d\x00%s", b.table, q.State, q.Prefix)
	return h.Sum(nil)[:8]
}

// encodeCursor encodes the last key a page read, for query q.
func (b *Backend) encodeCursor(q store.ListQuery, last []byte) string {
	buf := append([]byte{cursorVersion}, b.queryTag(q)...)
	return base64.RawURLEncoding.EncodeToString(append(buf, last...))
}

// decodeCursor returns the key q.Cursor continues after (nil when it is
// empty), or an error wrapping store.ErrInvalidQuery for a cursor that
// this backend did not issue for q's table, prefix and state.
func (b *Backend) decodeCursor(q store.ListQuery) ([]byte, error) {
	if q.Cursor == "" {
		return nil, nil
	}
	buf, err := base64.RawURLEncoding.DecodeString(q.Cursor)
	tag := b.queryTag(q)
	if err != nil || len(buf) < 1+len(tag) || buf[0] != cursorVersion || !bytes.Equal(buf[1:1+len(tag)], tag) {
		return nil, fmt.Errorf("%w: the cursor was not issued by this backend for this prefix and state", store.ErrInvalidQuery)
	}
	last := buf[1+len(tag):]
	if store.ValidateKey(string(last)) != nil || !bytes.HasPrefix(last, []byte(q.Prefix)) {
		return nil, fmt.Errorf("%w: the cursor's key is not under the prefix", store.ErrInvalidQuery)
	}
	return last, nil
}

// ForceRelease releases the claim r describes as its holder's Release
// would, in one DML statement that matches key, fence, state Claimed and
// the version of the stored token (computed by Spanner: SHA256 and
// TO_HEX), setting the lease expiry to CURRENT_TIMESTAMP() and raising
// the fence (2 RPCs with the commit). The token stays. A run of the
// transaction again (after an abort, or a Commit whose reply was lost)
// finds the raised fence and matches nothing, so at most one call
// releases; such a call may return false although it released.
func (b *Backend) ForceRelease(ctx context.Context, r store.Record) (bool, error) {
	if err := store.ValidateRecord(r); err != nil {
		return false, err
	}
	n, err := b.guarded(ctx, spanner.Statement{
		SQL: "UPDATE " + b.table + " SET fence = fence + 1, lease_expiry = CURRENT_TIMESTAMP(), " +
			"expires_at = TIMESTAMP_ADD(CURRENT_TIMESTAMP(), INTERVAL @ttl MICROSECOND) " +
			"WHERE key = @key AND fence = @fence AND state = 1 AND " + versionSQL + " = @version",
		Params: map[string]any{"key": []byte(r.Key), "fence": r.Fence, "version": r.Version, "ttl": micros(b.ttl)},
	})
	if err != nil {
		return false, fmt.Errorf("spannerlock: force-release %q fence %d: %w", r.Key, r.Fence, err)
	}
	return n > 0, nil
}

// Forget deletes the Done record r describes, in one DML statement that
// matches key, fence, state Done and the version of the stored token (2
// RPCs with the commit). It never deletes a Claimed row. A run of the
// transaction again finds no row and matches nothing; such a call may
// return false although it deleted.
func (b *Backend) Forget(ctx context.Context, r store.Record) (bool, error) {
	if err := store.ValidateRecord(r); err != nil {
		return false, err
	}
	n, err := b.guarded(ctx, spanner.Statement{
		SQL:    "DELETE FROM " + b.table + " WHERE key = @key AND fence = @fence AND state = 2 AND " + versionSQL + " = @version",
		Params: map[string]any{"key": []byte(r.Key), "fence": r.Fence, "version": r.Version},
	})
	if err != nil {
		return false, fmt.Errorf("spannerlock: forget %q fence %d: %w", r.Key, r.Fence, err)
	}
	return n > 0, nil
}

// guarded runs one DML statement in a read-write transaction and returns
// how many rows the run that committed changed: a count from a run whose
// Commit failed is never reported.
func (b *Backend) guarded(ctx context.Context, stmt spanner.Statement) (int64, error) {
	var n int64
	err := b.transact(ctx, func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
		n = 0
		var err error
		n, err = txn.Update(ctx, stmt)
		return err
	}, nil)
	if err != nil {
		return 0, err
	}
	return n, nil
}
