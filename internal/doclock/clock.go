package doclock

import (
	"errors"
	"sync"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// instant is base plus ds, rounded up to a whole microsecond and capped at
// store.MaxInstant ([store.Instant]). Both services keep timestamps in
// microseconds: what is stored is exactly what a claim reports, never a
// fraction of a microsecond earlier, and a lease or ttl near
// math.MaxInt64 never wraps an instant into the past.
func instant(base time.Time, ds ...time.Duration) time.Time {
	return store.Instant(base, time.Microsecond, ds...)
}

// maxObservationAge is how long a server timestamp serves as the base of an
// estimate of the server's time. Clock rates differ by up to a few hundred
// parts per million: a few milliseconds a minute.
const maxObservationAge = time.Minute

// clockMode says whose clock the backend judges by.
type clockMode int

const (
	modeUnknown clockMode = iota // nothing read yet
	modeServer                   // the service reports its time
	modeClient                   // it does not (the Datastore emulator): the client's clock
)

// Clock estimates the service's clock from the timestamps its replies
// carry. Each reply bounds the server's time: no later than its timestamp
// plus the time elapsed since its request was sent, no earlier than its
// timestamp plus the time elapsed since the reply arrived. It keeps the
// tightest of each bound seen within a minute, so one slow reply does not
// stretch the estimate. Build it with [NewClock].
type Clock struct {
	now    func() time.Time
	mu     sync.Mutex
	mode   clockMode
	hi, lo observation
}

// NewClock returns a Clock that reads the client's time from now (time.Now
// outside tests; its monotonic reading measures the time elapsed since a
// server timestamp arrived).
func NewClock(now func() time.Time) *Clock { return &Clock{now: now} }

// Now is the client's clock.
func (c *Clock) Now() time.Time { return c.now() }

// client is the client's clock in whole microseconds.
func (c *Clock) client() time.Time { return c.now().UTC().Truncate(time.Microsecond) }

// observation is a server timestamp and the client's clock when the
// request that brought it was sent and when its reply arrived.
type observation struct {
	at, sent, recv time.Time
}

// upper and lower are the bounds o sets on the server's time at the
// client's now (which, like sent and recv, carries time.Now's monotonic
// reading when it comes from time.Now).
func (o observation) upper(now time.Time) time.Time { return o.at.Add(now.Sub(o.sent)) }
func (o observation) lower(now time.Time) time.Time { return o.at.Add(now.Sub(o.recv)) }

// stale reports whether o is missing or too old to base an estimate on.
func (o observation) stale(now time.Time) bool {
	age := now.Sub(o.recv)
	return o.recv.IsZero() || age < 0 || age > maxObservationAge
}

// Observe records the server timestamp at of a reply (zero when it carries
// none) to a request sent at sent whose reply arrived at recv. A read whose
// reply carries none, before any did, means the service keeps no clock for
// us (the Datastore emulator).
func (c *Clock) Observe(at, sent, recv time.Time, read bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if at.IsZero() {
		if read && c.mode == modeUnknown {
			c.mode = modeClient
		}
		return
	}
	c.mode = modeServer
	o := observation{at: at, sent: sent, recv: recv}
	if c.hi.stale(recv) || o.upper(recv).Before(c.hi.upper(recv)) {
		c.hi = o
	}
	if c.lo.stale(recv) || o.lower(recv).After(c.lo.lower(recv)) {
		c.lo = o
	}
	if c.hi.upper(recv).Before(c.lo.lower(recv)) {
		// The bounds cross: the server's clock stepped (ahead or back)
		// since the older of the two replies. Only this reply describes
		// the clock as it runs now.
		c.hi, c.lo = o, o
	}
}

// Times returns a lower and an upper bound of the server's time now. ok is
// false when there is no recent server timestamp (read first). With the
// client's clock both bounds are its now.
func (c *Clock) Times() (lo, hi time.Time, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch c.mode {
	case modeClient:
		now := c.client()
		return now, now, true
	case modeServer:
		now := c.now()
		if c.hi.stale(now) || c.lo.stale(now) {
			return time.Time{}, time.Time{}, false
		}
		lo = c.lo.lower(now).Truncate(time.Microsecond)
		hi = c.hi.upper(now).Add(time.Microsecond - 1).Truncate(time.Microsecond)
		return lo, hi, true
	}
	return time.Time{}, time.Time{}, false
}

// maxUncertainty is the widest gap between the bounds of the server's
// time that a write still bases its instants on: the gap is the round trip
// of the requests the bounds came from, and the upper bound runs ahead of
// the server's time by up to the outbound half of it. A wider gap (a slow
// request, or a clock that jumped while one was in flight) makes the caller
// read first and base the write on that read.
const maxUncertainty = 100 * time.Millisecond

// estimate returns the upper bound of the server's time now to base a
// write on: ok is false when there is no recent server timestamp, or the
// bounds lie more than maxUncertainty apart, or they cross (the upper
// below the lower: the clocks disagree, and neither bound can be trusted).
func (c *Clock) estimate() (time.Time, bool) {
	lo, hi, ok := c.Times()
	if !ok || hi.Before(lo) || hi.Sub(lo) > maxUncertainty {
		return time.Time{}, false
	}
	return hi, true
}

// estimateSlack is how far the server's time that a write based its
// instants on may lie from the time the service gave the commit (the
// write's latency, clock drift) before the write counts as misplaced.
const estimateSlack = 100 * time.Millisecond

// ranAhead reports whether a write based on the estimate base landed at
// server time at (zero when unknown) that is well before base: the
// estimate ran ahead (it was taken from a request that was slow to
// arrive), so the write's instants lie after the call. Its outcome is
// then reported as unknown rather than with instants the call did not see.
func ranAhead(base, at time.Time) bool {
	return !at.IsZero() && base.After(at.Add(estimateSlack))
}

// ranBehind reports whether a write based on base landed at server time
// at (zero when unknown) further after base than the time elapsed since
// the call began (rtt, on the client's clock) explains: base lies before
// the call began, by the server's clock. The server's clock stepped ahead of the
// estimate, or the client's clock stood still. The write's lease or ttl
// then ends before the call could have made it, perhaps before the commit
// (a lease that lapsed as it was written lets a second caller win the key
// beside its holder), so the caller writes the instants again from at. A
// base within the call's window, however slow the write, is left alone: a
// second write would move instants that others may already have seen.
func ranBehind(base, at time.Time, rtt time.Duration) bool {
	return !at.IsZero() && at.Sub(base) > rtt+estimateSlack
}

// ErrNoServerTime reports a reply without the server's time from a service
// that otherwise gives it, with no recent estimate to fall back on.
var ErrNoServerTime = errors.New("the reply carries no read_time and no recent server time is known")

// Judge returns the reading of a reply that carried readTime (zero when
// none) and arrived at recv: judged by the read_time, else by the lower
// bound of the server's time (the client's clock where the service reports
// none).
func (c *Clock) Judge(readTime, recv time.Time) (Reading, error) {
	if !readTime.IsZero() {
		return Reading{At: readTime, Recv: recv, Exact: true}, nil
	}
	lo, _, ok := c.Times()
	if !ok {
		return Reading{}, ErrNoServerTime
	}
	return Reading{At: lo, Recv: recv}, nil
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// Reading is when a read was judged: At is the server's read_time when
// the reply carried one (Exact), else the estimate Judge fell back on;
// Recv is the client's clock when the reply arrived.
type Reading struct {
	At, Recv time.Time
	Exact    bool
}

// after returns the instant to base a write that follows read rd on: the
// read's read_time carried forward by the time elapsed since its reply
// arrived, which lies between the read and the server's now. Without a
// read_time, the estimate (the client's clock where the service reports
// none).
func (c *Clock) after(rd Reading) (time.Time, bool) {
	if rd.Exact {
		return rd.At.Add(max(c.now().Sub(rd.Recv), 0)).Truncate(time.Microsecond), true
	}
	return c.estimate()
}
