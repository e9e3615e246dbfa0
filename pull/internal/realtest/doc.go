// Package realtest holds the pull module's tests and benchmarks against
// real components (the Pub/Sub emulator, redis-server, PostgreSQL), in a
// test-only module of its own so that no consumer of the pull module gets
// a store driver in its module graph. It has no code outside its tests.
package realtest
