//go:build !race

package idempotency_test

// raceAllocSlack is what the race detector may add to an allocation count.
const raceAllocSlack = 0
