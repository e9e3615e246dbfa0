// Package telemetryswitch holds the switch that benchmarks flip to
// measure a delivery without any telemetry, beside one with it, in the
// same run. Nothing else sets it.
package telemetryswitch

import "sync/atomic"

// Off, when true, makes Lock and Mutex skip their spans and metrics
// altogether, as if the package had none.
var Off atomic.Bool
