package idempotency

// Disabled exposes disabled to the tests of package idempotency_test.
func Disabled() bool { return disabled() }
