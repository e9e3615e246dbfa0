// Package benchtest holds store/redislock's benchmarks against
// github.com/bsm/redislock, in a test-only module of its own so that no
// consumer of store/redislock gets bsm/redislock in its module graph. It
// has no code outside its tests.
package benchtest
