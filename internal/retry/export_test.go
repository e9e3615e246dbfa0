package retry

import "time"

// WithAfter returns p waiting on after instead of time.After.
func WithAfter(p Policy, after func(time.Duration) <-chan time.Time) Policy {
	p.after = after
	return p
}
