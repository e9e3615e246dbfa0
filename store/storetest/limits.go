package storetest

import (
	"errors"
	"math"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// limits are the leases and ttls at the top of time.Duration's range that
// the limit cases use: math.MaxInt64 (the usual spelling of "forever",
// and what a lease sized from a context deadline centuries away saturates
// to), 500ns less (not a whole microsecond or millisecond, so rounding it
// up to a store's unit the usual way, d + unit - 1, wraps too), and 250
// years (no wrap, but the instant it gives is centuries ahead). The port
// accepts every positive duration and saturates (store.Instant): each
// must hold a key or a record at least as long as asked, up to
// store.MaxInstant, never end it in the past.
var limits = []struct {
	name string
	d    time.Duration
}{
	{"MaxInt64", math.MaxInt64},
	{"MaxInt64-500ns", math.MaxInt64 - 500},
	{"250y", 250 * 365 * 24 * time.Hour},
}

// until is base + d by the port's arithmetic: saturating at
// store.MaxInstant, never wrapping.
func until(base time.Time, d time.Duration) time.Time { return store.Instant(base, 0, d) }

// leaseLimits claims fresh keys, and keys whose lease lapsed, with leases
// at the limit of time.Duration. Each claim holds its key (a second Claim
// is held by other, a purge leaves the record), and once completed the
// key is done. A lease rounded the usual way wraps into the past, and a
// second caller wins the key at once: two holders.
func leaseLimits(t *testing.T, e *env) {
	type keys struct{ fresh, lapsed string }
	ks := make([]keys, len(limits))
	lapsed := make([]store.Claim, len(limits))
	for i, l := range limits {
		ks[i] = keys{e.key() + "/fresh/" + l.name, e.key() + "/lapsed/" + l.name}
		lapsed[i] = e.won(ks[i].lapsed, e.short())
	}
	e.pass(e.short())
	for i, l := range limits {
		for _, k := range []string{ks[i].fresh, ks[i].lapsed} {
			c := e.won(k, l.d) // its LeaseExpiry is checked against now + lease
			// The lapsed record may have been reaped once its expires-at
			// passed (a slow machine in real time): a fresh one starts at 1.
			reaped := c.Fence == 1 && !e.h.Now().Before(lapsed[i].LeaseExpiry.Add(e.h.TTL))
			if k == ks[i].lapsed && c.Fence != lapsed[i].Fence+1 && !reaped {
				t.Fatalf("reclaim of %q with a lease of %v: fence %d, want %d", k, l.d, c.Fence, lapsed[i].Fence+1)
			}
			r := e.expect(k, store.HeldByOther)
			if !r.Until.IsZero() && !sameInstant(r.Until, c.LeaseExpiry) {
				t.Fatalf("%q claimed with a lease of %v: HeldByOther.Until = %v, want the lease expiry %v", k, l.d, r.Until, c.LeaseExpiry)
			}
			if r := e.claim(k, l.d); r.Outcome != store.HeldByOther {
				t.Fatalf("a second claim of %q, both with a lease of %v: %v, want held by other", k, l.d, r.Outcome)
			}
			e.purgeIfAble()
			e.expect(k, store.HeldByOther)
			e.complete(c, true)
			e.expect(k, store.AlreadyDone)
		}
	}
}

// extendLimits extends claims to leases at the limit of time.Duration.
// Each extended claim holds its key past its first lease (a Claim is held
// by other, a purge leaves the record), and completes.
func extendLimits(t *testing.T, e *env) {
	x := e.extender()
	ks := make([]string, len(limits))
	exts := make([]store.Claim, len(limits))
	for i, l := range limits {
		ks[i] = e.key() + "/" + l.name
		c := e.won(ks[i], e.short())
		before := e.h.Now()
		ext, err := x.Extend(e.ctx, c, l.d)
		after := e.h.Now()
		if err != nil {
			t.Fatalf("Extend(%q, %v): %v", ks[i], l.d, err)
		}
		if ext.Fence != c.Fence || ext.Token != c.Token {
			t.Fatalf("Extend(%q, %v) returned fence %d token %q, want the claim's %d %q", ks[i], l.d, ext.Fence, ext.Token, c.Fence, c.Token)
		}
		e.within("Extend's LeaseExpiry", ext.LeaseExpiry, until(before, l.d), until(after, l.d))
		exts[i] = ext
	}
	e.pass(e.short()) // the first leases lapse
	for i, l := range limits {
		k := ks[i]
		r := e.expect(k, store.HeldByOther)
		if !r.Until.IsZero() && !sameInstant(r.Until, exts[i].LeaseExpiry) {
			t.Fatalf("%q extended by %v: HeldByOther.Until = %v, want the extended lease expiry %v", k, l.d, r.Until, exts[i].LeaseExpiry)
		}
		e.purgeIfAble()
		e.expect(k, store.HeldByOther)
		e.complete(exts[i], true)
		e.expect(k, store.AlreadyDone)
	}
}

// ttlLimits builds a backend with each ttl at the limit of time.Duration
// (Harness.WithTTL) and checks that its records outlive a lapsed lease, a
// release and an extended lease by that ttl (a purge leaves them, and the
// next claim raises the fence), and that a completed key stays done (also
// after a purge) until completion + ttl. A ttl rounded the usual way
// wraps into the past: a done key is won again at once, and a purge
// deletes a record within its ttl.
func ttlLimits(t *testing.T, e *env) {
	if e.h.WithTTL == nil {
		t.Skip("Harness.WithTTL is nil: ttls at the limit of time.Duration are not checked; every backend with a ttl option should provide it")
	}
	type run struct {
		e                         *env
		ttl                       time.Duration
		lapsed, released, forever string
		cl, cr, cf                store.Claim
		extended                  string
		ce                        store.Claim
	}
	runs := make([]*run, len(limits))
	for i, l := range limits {
		b := e.h.WithTTL(l.d)
		if b == nil {
			t.Fatalf("Harness.WithTTL(%v) returned nil", l.d)
		}
		h := e.h
		h.Backend, h.TTL = b, l.d
		te := &env{t: t, h: h, ctx: e.ctx, base: e.base + "/ttl-" + l.name, done: map[string]completion{}}
		r := &run{e: te, ttl: l.d}
		r.lapsed, r.released, r.forever = te.key(), te.key(), te.key()
		r.cl = te.won(r.lapsed, te.short())
		r.cr = te.won(r.released, te.long())
		te.release(r.cr)
		// A lease at the limit too: its record expires centuries after
		// its lease, which is centuries away.
		r.cf = te.won(r.forever, limits[0].d)
		if x, ok := b.(store.Extender); ok {
			r.extended = te.key()
			c := te.won(r.extended, te.short())
			ext, err := x.Extend(e.ctx, c, te.short())
			if err != nil {
				t.Fatalf("Extend(%q) on a backend with a ttl of %v: %v", r.extended, l.d, err)
			}
			r.ce = ext
		}
		runs[i] = r
	}
	e.pass(e.short()) // every lease but the forever claims' lapses
	for _, r := range runs {
		te := r.e
		purge := func() {
			te.purgeIfAble()
			e.purgeIfAble() // Backend's may share the storage
		}
		purge()
		next := te.won(r.lapsed, te.long())
		if next.Fence != r.cl.Fence+1 {
			t.Fatalf("ttl %v: claim after a lapsed lease and a purge: fence %d, want %d (the record must outlive its lease by the ttl)", r.ttl, next.Fence, r.cl.Fence+1)
		}
		if n := te.won(r.released, te.long()); n.Fence != r.cr.Fence+2 {
			t.Fatalf("ttl %v: claim after a release and a purge: fence %d, want %d (the record must outlive the release by the ttl)", r.ttl, n.Fence, r.cr.Fence+2)
		}
		if r.extended != "" {
			if n := te.won(r.extended, te.long()); n.Fence != r.ce.Fence+1 {
				t.Fatalf("ttl %v: claim after an extended lease lapsed and a purge: fence %d, want %d (the record must outlive its new lease by the ttl)", r.ttl, n.Fence, r.ce.Fence+1)
			}
		}
		te.expect(r.forever, store.HeldByOther)
		te.complete(r.cl, false)
		before, after := te.completeWindow(next)
		te.complete(r.cf, true)
		purge()
		for _, k := range []string{r.lapsed, r.forever} {
			d := te.expect(k, store.AlreadyDone)
			if !d.Until.IsZero() && k == r.lapsed {
				te.within("AlreadyDone.Until", d.Until, until(before, r.ttl), until(after, r.ttl))
			}
			if d := te.claim(k, limits[0].d); d.Outcome != store.AlreadyDone {
				t.Fatalf("ttl %v: a claim of done %q with a lease of %v: %v, want already done", r.ttl, k, limits[0].d, d.Outcome)
			}
		}
		if x, ok := te.h.Backend.(store.Extender); ok {
			if _, err := x.Extend(e.ctx, next, te.long()); !errors.Is(err, store.ErrLost) {
				t.Fatalf("ttl %v: Extend of a done claim: %v, want ErrLost", r.ttl, err)
			}
		}
	}
}
