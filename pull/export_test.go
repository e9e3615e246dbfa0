package pull

import (
	"testing"
	"time"
)

// SetNackDelay sets the bound of the wait before a 503's nack for the
// test t.
func SetNackDelay(t testing.TB, d time.Duration) {
	old := nackDelayMax
	nackDelayMax = d
	t.Cleanup(func() { nackDelayMax = old })
}

// SetAckWait sets the bound of the wait for an ack's result for the
// test t.
func SetAckWait(t testing.TB, d time.Duration) {
	old := ackWait
	ackWait = d
	t.Cleanup(func() { ackWait = old })
}
