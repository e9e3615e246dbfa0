package datastorelock_test

import (
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
)

// How cost grows (docs/scaling/datastore.md), on the emulator: the benchmarks
// of doclocktest.

// BenchmarkScaling is a delivery through Lock at 1, 4, 16 and 64 workers.
func BenchmarkScaling(b *testing.B) { doclocktest.BenchScaling(b, driver{}) }

// BenchmarkRace has N deliveries of one key race.
func BenchmarkRace(b *testing.B) { doclocktest.BenchRace(b, driver{}) }

// BenchmarkPurgeWhileClaiming times one PurgeExpired over expired records
// while 4 workers claim fresh keys.
func BenchmarkPurgeWhileClaiming(b *testing.B) { doclocktest.BenchPurgeWhileClaiming(b, driver{}) }
