// Package broken holds the backend defects the crash storms must catch
// (brokenBackends in the e2e tests). The pull storm's subscriber imports
// it; the push storm's broken function server is built with this file
// copied into its main package (see brokenServer), so both storms break
// the backend the same way.
package broken

import (
	"context"
	"fmt"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Wrap wraps b in the defect named: "complete-noop" or
// "claim-always-wins"; "" returns b itself.
func Wrap(b store.Backend, defect string) (store.Backend, error) {
	switch defect {
	case "":
		return b, nil
	case "complete-noop":
		return completeNoop{b}, nil
	case "claim-always-wins":
		return claimAlwaysWins{b}, nil
	}
	return nil, fmt.Errorf("E2E_BROKEN=%q: unknown defect", defect)
}

// completeNoop reports every Complete as done without writing it: the
// record stays Claimed and the next delivery after the lease runs the
// body again.
type completeNoop struct{ store.Backend }

func (completeNoop) Complete(context.Context, store.Claim) (bool, error) { return true, nil }

// claimAlwaysWins turns every outcome of Claim into Won, with a fence
// above any real one (so only the storm's other rules can catch it).
type claimAlwaysWins struct{ store.Backend }

func (b claimAlwaysWins) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	r, err := b.Backend.Claim(ctx, key, lease)
	if err != nil || r.Outcome == store.Won {
		return r, err
	}
	return store.Result{Outcome: store.Won, Claim: store.Claim{Key: key, Fence: time.Now().UnixNano(),
		Token: store.NewToken(), LeaseExpiry: time.Now().Add(lease)}}, nil
}
