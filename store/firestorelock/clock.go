package firestorelock

import (
	"errors"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"
)

// wholeMicros rounds d up to a whole microsecond. Firestore keeps
// timestamp values in microseconds: instants are computed from bases in whole
// microseconds plus durations rounded up this way, so what is stored is
// exactly what a claim reports, never a fraction of a microsecond earlier.
func wholeMicros(d time.Duration) time.Duration {
	return (d + time.Microsecond - 1).Truncate(time.Microsecond)
}

func (b *Backend) clock() time.Time { return b.now().UTC().Truncate(time.Microsecond) }

// maxObservationAge is how long a server timestamp serves as the base of an
// estimate of the server's time. Clock rates differ by up to a few hundred
// parts per million: a few milliseconds a minute.
const maxObservationAge = time.Minute

// clockMode says whose clock the backend judges by.
type clockMode int

const (
	modeUnknown clockMode = iota // nothing read yet
	modeServer                   // the service reports its time
	modeClient                   // it does not: the client's clock
)

// serverClock estimates the service's clock from the timestamps its replies
// carry. Each reply bounds the server's time: no later than its timestamp
// plus the time elapsed since its request was sent, no earlier than its
// timestamp plus the time elapsed since the reply arrived. It keeps the
// tightest of each bound seen within maxObservationAge, so one slow reply
// does not stretch the estimate.
type serverClock struct {
	mu     sync.Mutex
	mode   clockMode
	hi, lo observation
}

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

// observe records the server timestamp ts of a reply (nil when it carries
// none) to a request sent at sent whose reply arrived at recv. A read whose
// reply carries none, before any did, means the service keeps no clock for
// us (Firestore and its emulator always report one).
func (b *Backend) observe(ts *timestamppb.Timestamp, sent, recv time.Time, read bool) {
	b.sc.mu.Lock()
	defer b.sc.mu.Unlock()
	if ts == nil || !ts.IsValid() {
		if read && b.sc.mode == modeUnknown {
			b.sc.mode = modeClient
		}
		return
	}
	b.sc.mode = modeServer
	o := observation{at: ts.AsTime(), sent: sent, recv: recv}
	if b.sc.hi.stale(recv) || o.upper(recv).Before(b.sc.hi.upper(recv)) {
		b.sc.hi = o
	}
	if b.sc.lo.stale(recv) || o.lower(recv).After(b.sc.lo.lower(recv)) {
		b.sc.lo = o
	}
}

// times returns a lower and an upper bound of the server's time now. ok is
// false when there is no recent server timestamp (read first). With the
// client's clock both bounds are its now.
func (b *Backend) times() (lo, hi time.Time, ok bool) {
	b.sc.mu.Lock()
	defer b.sc.mu.Unlock()
	switch b.sc.mode {
	case modeClient:
		now := b.clock()
		return now, now, true
	case modeServer:
		now := b.now()
		if b.sc.hi.stale(now) || b.sc.lo.stale(now) {
			return time.Time{}, time.Time{}, false
		}
		lo = b.sc.lo.lower(now).Truncate(time.Microsecond)
		hi = b.sc.hi.upper(now).Add(time.Microsecond - 1).Truncate(time.Microsecond)
		return lo, hi, true
	}
	return time.Time{}, time.Time{}, false
}

// estimateSlack is how far the estimate of the server's time that a write
// was based on may run ahead of the time the service gave the commit
// (outbound latency, clock drift) before the write counts as misplaced.
const estimateSlack = 100 * time.Millisecond

// misplaced reports whether a write based on the estimate base landed at
// server time at (zero when unknown) that is well before base: the
// estimate ran ahead (it was taken from a request that was slow to
// arrive), so the write's instants lie after the call. Its outcome is
// then reported as unknown rather than with instants the call did not see.
func misplaced(base, at time.Time) bool {
	return !at.IsZero() && base.After(at.Add(estimateSlack))
}

// errNoServerTime reports a reply without the server's time from a service
// that otherwise gives it, with no recent estimate to fall back on.
var errNoServerTime = errors.New("firestorelock: the reply carries no read_time and no recent server time is known")

// judge returns the instant to judge a read by: the reply's read_time, else
// the lower bound of the server's time (the client's clock when the service reports none).
func (b *Backend) judge(readTime *timestamppb.Timestamp) (time.Time, error) {
	if readTime != nil && readTime.IsValid() {
		return readTime.AsTime(), nil
	}
	lo, _, ok := b.times()
	if !ok {
		return time.Time{}, errNoServerTime
	}
	return lo, nil
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// reading is when a read was judged: the server's read_time when the reply
// carried one (exact), else the estimate judge fell back on; and the
// client's clock when the reply arrived.
type reading struct {
	at, recv time.Time
	exact    bool
}

// after returns the instant to base a write that follows read rd on: the
// read's read_time carried forward by the time elapsed since its reply
// arrived, which lies between the read and the server's now. Without a
// read_time, the upper bound of the server's time (the client's clock
// when the service reports none).
func (b *Backend) after(rd reading) (time.Time, bool) {
	if rd.exact {
		return rd.at.Add(max(b.now().Sub(rd.recv), 0)).Truncate(time.Microsecond), true
	}
	_, hi, ok := b.times()
	return hi, ok
}
