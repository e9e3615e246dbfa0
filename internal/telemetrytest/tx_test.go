package telemetrytest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
)

type noTx struct{}

// LockTx's outcomes are traced and counted like Lock's, and no span of
// them carries the key: a commit, a body error, a claim superseded before
// the commit, a failed commit.
func TestEveryTxOutcomeIsTracedAndCountedWithoutTheKey(t *testing.T) {
	commitErr := errors.New("commit refused for " + key)
	cases := []struct {
		name        string
		commit      error
		body        func(b *fake.TxStore[noTx], clock *fake.Clock) error
		wantOutcome string
	}{
		{"won", nil, func(*fake.TxStore[noTx], *fake.Clock) error { return nil }, idempotency.OutcomeWon},
		{"failed", nil, func(*fake.TxStore[noTx], *fake.Clock) error { return errors.New("supplier refused " + key) }, idempotency.OutcomeFailed},
		{"superseded", nil, func(b *fake.TxStore[noTx], clock *fake.Clock) error {
			clock.Advance(time.Hour)
			_, err := b.Claim(context.Background(), key, time.Minute)
			return err
		}, idempotency.OutcomeFencedOut},
		{"commit_failed", commitErr, func(*fake.TxStore[noTx], *fake.Clock) error { return nil }, idempotency.OutcomeCompleteFailed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := newRig(t)
			clock := fake.NewClock(epoch)
			b := fake.NewTx(fake.New(fake.WithClock(clock.Now)),
				func(context.Context) (noTx, error) { return noTx{}, nil },
				func(noTx) error { return c.commit },
				func(noTx) error { return nil })
			opts := append(r.opts(), idempotency.WithLogger(discard), idempotency.WithLease(time.Minute))
			_ = idempotency.LockTx(t.Context(), b, key, func(context.Context, noTx) error { return c.body(b, clock) }, opts...)
			spans := r.spans()
			if len(spans) == 0 {
				t.Fatal("no spans")
			}
			if v, _ := attr(spans[0], "idempotency.outcome"); v.AsString() != c.wantOutcome {
				t.Errorf("outcome %q, want %q", v.AsString(), c.wantOutcome)
			}
			keyFree(t, spans, key)
			if got := r.collect(t)["idempotency.deliveries {delivery}"]["idempotency.outcome="+c.wantOutcome]; got != 1 {
				t.Errorf("deliveries counted as %s: %d, want 1", c.wantOutcome, got)
			}
		})
	}
}
