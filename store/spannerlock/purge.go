package spannerlock

import (
	"context"
	"fmt"

	"cloud.google.com/go/spanner"
	"google.golang.org/api/iterator"
)

// purgeBatch is how many rows one transaction of PurgeExpired deletes at
// most.
const purgeBatch = 1000

// PurgeExpired deletes at most limit rows whose expires_at has passed by
// Spanner's clock (all of them when limit <= 0), for tables without a row
// deletion policy. Each batch is a single-use read-only query for expired
// keys (no locks), then one read-write transaction whose DML deletes those
// of them still expired by its own CURRENT_TIMESTAMP(), so a row that a
// Claim renewed in between stays.
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
		stmt := spanner.Statement{
			SQL:    "DELETE FROM " + b.table + " WHERE key IN UNNEST(@keys) AND expires_at < CURRENT_TIMESTAMP()",
			Params: map[string]any{"keys": keys},
		}
		var deleted int64
		err = b.transact(ctx, func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
			var err error
			deleted, err = txn.Update(ctx, stmt)
			return err
		}, nil)
		if err != nil {
			return total, fmt.Errorf("spannerlock: purge: %w", err)
		}
		total += int(deleted)
		if len(keys) < n {
			break
		}
	}
	return total, nil
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
