//go:build race

package idempotency_test

// raceAllocSlack is what the race detector may add to an allocation count:
// it makes sync.Pool drop items at random, so pooled buffers are allocated
// again.
const raceAllocSlack = 4
