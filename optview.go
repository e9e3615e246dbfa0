package idempotency

import "github.com/gcp-pubsub-idempotency/idempotency/internal/optview"

func init() {
	optview.Of = func(opts any) optview.View {
		o, _ := opts.([]Option)
		cfg := newConfig(o)
		return optview.View{
			Logger:       cfg.lock.log(),
			Lease:        cfg.lock.lease,
			Heartbeat:    cfg.lock.heartbeat,
			FromDeadline: cfg.lock.fromDeadline,
		}
	}
}
