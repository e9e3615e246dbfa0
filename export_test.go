package idempotency

import "time"

// Disabled exposes disabled to the tests of package idempotency_test.
func Disabled() bool { return disabled() }

// WithNow sets the clock against which WithLeaseFromDeadline measures the
// time left until ctx's deadline.
func WithNow(now func() time.Time) LockOption {
	return lockOption(func(c *lockConfig) { c.now = now })
}
