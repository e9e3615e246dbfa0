// Package optview lets the entry points in this repository's other
// modules (the pull module) read what the root package's options set,
// without exporting it from the root package: the root package sets Of
// in its init, so it is set in every program that imports it.
package optview

import (
	"log/slog"
	"time"
)

// View is what the entry points read of a []idempotency.Option.
type View struct {
	// Logger is the logger WithLogger set, else slog.Default().
	Logger *slog.Logger
	// Lease is the claim's lease (WithLease, else the default).
	Lease time.Duration
	// Heartbeat is WithHeartbeat's interval; zero without one.
	Heartbeat time.Duration
	// FromDeadline reports WithLeaseFromDeadline: the lease is sized
	// from the context's deadline instead of Lease.
	FromDeadline bool
}

// Of returns the view of opts, a []idempotency.Option.
var Of func(opts any) View
