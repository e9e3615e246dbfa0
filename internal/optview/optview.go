// Package optview lets the entry points in this repository's other
// modules (the pull module) read what the root package's options set,
// without exporting it from the root package: the root package sets
// Logger in its init, so it is set in every program that imports it.
package optview

import "log/slog"

// Logger returns the logger that opts, a []idempotency.Option, set with
// WithLogger, or slog.Default() when they set none.
var Logger func(opts any) *slog.Logger
