package spannerlock_test

import (
	"context"
	"hash/fnv"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
)

// shards is a store.Backend that sends each key to one of several
// spannerlock Backends, each on a database of its own, always the same
// one for a key. The emulator runs one read-write transaction at a time
// per database, so the history check's 150 clients on one database
// mostly wait, and most of their calls end in errors; spread over
// databases they run side by side. Every call is still a call of
// spannerlock on the key's own row, and the history check judges each
// key as a history of its own, so nothing it checks is lost.
type shards []*spannerlock.Backend

var (
	_ store.Backend       = shards(nil)
	_ store.Extender      = shards(nil)
	_ store.Purger        = shards(nil)
	_ store.Fingerprinter = shards(nil)
)

func (s shards) of(key string) *spannerlock.Backend {
	h := fnv.New32a()
	h.Write([]byte(key))
	return s[h.Sum32()%uint32(len(s))]
}

func (s shards) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	return s.of(key).Claim(ctx, key, lease)
}

func (s shards) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return s.of(c.Key).Complete(ctx, c)
}

func (s shards) CompleteFingerprint(ctx context.Context, c store.Claim, fp string) (bool, error) {
	return s.of(c.Key).CompleteFingerprint(ctx, c, fp)
}

func (s shards) Release(ctx context.Context, c store.Claim) error {
	return s.of(c.Key).Release(ctx, c)
}

func (s shards) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	return s.of(c.Key).Extend(ctx, c, lease)
}

// PurgeExpired purges each shard in turn, up to limit rows in all.
func (s shards) PurgeExpired(ctx context.Context, limit int) (int, error) {
	total := 0
	for _, b := range s {
		if limit > 0 && total >= limit {
			break
		}
		n, err := b.PurgeExpired(ctx, max(0, limit-total))
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}
