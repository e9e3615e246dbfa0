package spannerlock

import (
	"context"
	"errors"
	"fmt"
	"time"

	"cloud.google.com/go/spanner"
	"google.golang.org/api/iterator"
)

// purgeBatch is how many rows one transaction of PurgeExpired deletes at
// most.
const purgeBatch = 1000

// PurgeExpired deletes at most limit rows whose expires_at has passed by
// Spanner's clock (all of them when limit <= 0), for tables without a row
// deletion policy. Each batch is a single-use read-only query for expired
// keys (no locks), then one read-write transaction that reads
// CURRENT_TIMESTAMP() and those keys' rows by key, and deletes those
// still expired by that instant, so a row that a Claim renewed in between
// stays (3 RPCs: the query that begins the transaction, the read, the
// Commit with the deletions).
func (b *Backend) PurgeExpired(ctx context.Context, limit int) (int, error) {
	total := 0
	for limit <= 0 || total < limit {
		n := purgeBatch
		if limit > 0 {
			n = min(n, limit-total)
		}
		keys, err := b.expired(ctx, n)
		if err != nil {
			return total, fmt.Errorf("spannerlock: purge: %w", err)
		}
		if len(keys) == 0 {
			break
		}
		deleted, err := b.deleteExpired(ctx, keys)
		if err != nil {
			return total, fmt.Errorf("spannerlock: purge: %w", err)
		}
		total += deleted
		if len(keys) < n {
			break
		}
	}
	return total, nil
}

// deleteExpired deletes, in one read-write transaction, the rows of keys
// whose expires_at is before the transaction's CURRENT_TIMESTAMP(), and
// returns how many it deleted. It reads the rows by key and deletes them
// with mutations rather than with one DML statement over the keys: a
// round trip more per batch of up to a thousand rows on Spanner, but the
// emulator's SQL engine reads the whole table for every key of a DML
// statement's IN list (326 rows purged a second on a table of 1,000).
func (b *Backend) deleteExpired(ctx context.Context, keys [][]byte) (int, error) {
	set := make([]spanner.KeySet, len(keys))
	for i, k := range keys {
		set[i] = spanner.Key{k}
	}
	var deleted int
	err := b.transact(ctx, func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
		deleted = 0
		var now time.Time
		err := txn.Query(ctx, spanner.Statement{SQL: "SELECT CURRENT_TIMESTAMP()"}).Do(func(r *spanner.Row) error {
			return r.Columns(&now)
		})
		if err != nil {
			return err
		}
		if now.IsZero() {
			return errors.New("spannerlock: CURRENT_TIMESTAMP() returned no row")
		}
		var ms []*spanner.Mutation
		err = txn.Read(ctx, b.table, spanner.KeySets(set...), []string{"key", "expires_at"}).Do(func(r *spanner.Row) error {
			var (
				k   []byte
				exp time.Time
			)
			if err := r.Columns(&k, &exp); err != nil {
				return err
			}
			if exp.Before(now) {
				ms = append(ms, spanner.Delete(b.table, spanner.Key{k}))
			}
			return nil
		})
		if err != nil || len(ms) == 0 {
			return err
		}
		deleted = len(ms)
		return txn.BufferWrite(ms)
	}, nil)
	return deleted, err
}

// expired returns up to n keys whose rows have expired, read outside any
// transaction.
func (b *Backend) expired(ctx context.Context, n int) ([][]byte, error) {
	stmt := spanner.Statement{
		SQL:    "SELECT key FROM " + b.table + " WHERE expires_at < CURRENT_TIMESTAMP() LIMIT @n",
		Params: map[string]any{"n": int64(n)},
	}
	var keys [][]byte
	err := b.policy.Do(ctx, func(int) error {
		keys = keys[:0]
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
			var k []byte
			if err := r.Columns(&k); err != nil {
				return err
			}
			keys = append(keys, k)
		}
	}, retryable)
	return keys, err
}
