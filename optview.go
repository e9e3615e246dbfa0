package idempotency

import (
	"log/slog"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/optview"
)

func init() {
	optview.Logger = func(opts any) *slog.Logger {
		o, _ := opts.([]Option)
		cfg := newConfig(o)
		return cfg.lock.log()
	}
}
