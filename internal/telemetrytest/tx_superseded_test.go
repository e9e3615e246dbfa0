package telemetrytest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A LockTx claim superseded while the body runs is one outcome (an
// *InProgressError with Superseded, a 503 nack, nothing committed, the key
// not released), counted fenced_out with or without a heartbeat: under
// WithHeartbeat the renewal cancels the body, which returns its context's
// error, and 043743a counted that "failed" with the span status "context
// canceled".
func TestTxSupersededUnderAHeartbeatIsCountedFencedOut(t *testing.T) {
	r := newRig(t)
	b := fake.NewTx(fake.New(),
		func(context.Context) (noTx, error) { return noTx{}, nil },
		func(noTx) error { return nil },
		func(noTx) error { return nil })
	opts := append(r.opts(), idempotency.WithLogger(discard), idempotency.WithLease(time.Minute),
		idempotency.WithHeartbeat(idempotency.MinHeartbeat))
	err := idempotency.LockTx(t.Context(), b, key, func(ctx context.Context, _ noTx) error {
		c, _ := idempotency.ClaimFrom(ctx)
		if err := b.Release(context.Background(), c); err != nil { // idemctl release
			return err
		}
		if res, err := b.Claim(context.Background(), key, time.Hour); err != nil || res.Outcome != store.Won {
			return errors.New("the other delivery did not win")
		}
		<-ctx.Done() // the next renewal finds the claim lost
		return ctx.Err()
	}, opts...)
	var ip *idempotency.InProgressError
	if !errors.As(err, &ip) || !ip.Superseded {
		t.Fatalf("LockTx = %v, want a superseded *InProgressError", err)
	}
	spans := r.spans()
	got, _ := attr(spans[0], "idempotency.outcome")
	counted := r.collect(t)["idempotency.deliveries {delivery}"]
	if got.AsString() != idempotency.OutcomeFencedOut {
		t.Errorf("superseded under a heartbeat: outcome %q (counted %v), want %q as without a heartbeat; span status %q",
			got.AsString(), counted, idempotency.OutcomeFencedOut, spans[0].Status().Description)
	}
}
