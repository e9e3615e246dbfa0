package datastorelock

import (
	"context"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The store.Backend methods are those of the lock this package shares with
// firestorelock (internal/doclock), on the requests of datastore.go.

// Claim implements store.Backend: an insert for a fresh key (1 RPC), else a
// lookup and, to reclaim, a versioned update (2 or 3 RPCs). Without a
// recent server timestamp it reads before it inserts.
//
// A retry that cannot tell whether a write of this call whose reply was
// lost had won returns an error, not HeldByOther or AlreadyDone: that is
// when the record is found in other hands at or after the lease that write
// would have stored (before it, nobody could have taken the key from it).
func (b *Backend) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	return b.lk.Claim(ctx, key, lease)
}

// Complete implements store.Backend: one versioned update when the claim
// is unchanged. The Done record expires a ttl after the server's time (its
// upper bound) when the update was sent. When a retry after a lost reply
// finds the record in other hands at a time when the completion, had it
// applied, could already have expired and been reclaimed, Complete returns
// an error: it cannot tell.
func (b *Backend) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return b.lk.Complete(ctx, c)
}

// CompleteFingerprint implements store.Fingerprinter: Complete that also
// stores fp in the Done record's fingerprint property (not indexed), which
// a Claim that finds the record Done reports in Result.Fingerprint. A
// record written without the property (by an older version, or by
// Complete) reports none.
func (b *Backend) CompleteFingerprint(ctx context.Context, c store.Claim, fp string) (bool, error) {
	return b.lk.CompleteFingerprint(ctx, c, fp)
}

// Release implements store.Backend: one versioned update when the claim is
// unchanged. The lease is set to the server's time (its upper bound) when
// the update is sent, so the key is reclaimable once the update applies
// (give or take the latency of the request that brought the estimate).
func (b *Backend) Release(ctx context.Context, c store.Claim) error {
	return b.lk.Release(ctx, c)
}

// Extend implements store.Extender: the lease runs for lease from the
// server's time (its upper bound) when the update was sent. While this
// Backend's CompleteTx of the same claim is between its read of the record
// and its commit's answer, Extend waits for it (or for ctx's end), and then
// finds the record Done when the commit landed (store.ErrLost).
func (b *Backend) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	return b.lk.Extend(ctx, c, lease)
}
