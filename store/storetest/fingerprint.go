package storetest

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The cases of this file check store.Fingerprinter. A wrong fingerprint
// costs a delivery either way: one left over from an earlier life of the
// record, or stored by a claim that was replaced, makes a true redelivery
// look like a changed payload (nacked until the dead-letter topic takes
// it); one dropped makes a changed payload look like a duplicate (acked,
// and the change is lost).

// fingerprinter returns the backend as a store.Fingerprinter, or skips the
// case when it is not one.
func (e *env) fingerprinter() store.Fingerprinter {
	e.t.Helper()
	f, ok := e.h.Backend.(store.Fingerprinter)
	if !ok {
		e.t.Skipf("%T does not implement store.Fingerprinter: payload fingerprints are not checked (without them, a key reused with another payload is taken for a duplicate)", e.h.Backend)
	}
	return f
}

// completeFP calls CompleteFingerprint, which must answer want without an
// error.
func (e *env) completeFP(f store.Fingerprinter, c store.Claim, fp string, want bool) {
	e.t.Helper()
	before := e.h.Now()
	ok, err := f.CompleteFingerprint(e.ctx, c, fp)
	if err != nil {
		e.t.Fatalf("CompleteFingerprint(%q, fence %d, %.20q): %v", c.Key, c.Fence, fp, err)
	}
	if ok != want {
		e.t.Fatalf("CompleteFingerprint(%q, fence %d, %.20q) = %v, want %v", c.Key, c.Fence, fp, ok, want)
	}
	if d, seen := e.done[c.Key]; ok && (!seen || d.fence != c.Fence) {
		e.done[c.Key] = completion{c.Fence, before}
	}
}

// doneWith claims key, which must be already done with fingerprint fp.
func (e *env) doneWith(key, fp string) store.Result {
	e.t.Helper()
	r := e.expect(key, store.AlreadyDone)
	if r.Fingerprint != fp {
		e.t.Fatalf("Claim(%q): already done with fingerprint %q, want %q", key, r.Fingerprint, fp)
	}
	return r
}

// fpReported: the fingerprint a Complete stored is reported by every claim
// of the done key, short-lease ones too, until its ttl ends, counted from
// the completion as for a plain Complete.
func fpReported(t *testing.T, e *env) {
	f := e.fingerprinter()
	k := e.key()
	const fp = "sha256:0123456789abcdef"
	c := e.won(k, e.long())
	e.pass(e.short())
	before := e.h.Now()
	e.completeFP(f, c, fp, true)
	after := e.h.Now()
	r := e.doneWith(k, fp)
	if !r.Until.IsZero() {
		e.within("AlreadyDone.Until", r.Until, before.Add(e.h.TTL), after.Add(e.h.TTL))
	}
	e.pass(e.h.TTL / 2)
	e.doneWith(k, fp)
	r = e.claim(k, e.short())
	if r.Outcome != store.AlreadyDone {
		if e.h.Advance == nil && !e.h.Now().Before(before.Add(e.h.TTL)) {
			t.Skipf("short-lease claim of a done key: %v, but the case ran slower than the ttl: nothing to conclude", r.Outcome)
		}
		t.Fatalf("short-lease claim of a done key: %v, want already done", r.Outcome)
	}
	if r.Fingerprint != fp {
		t.Fatalf("short-lease claim of a done key: fingerprint %q, want %q", r.Fingerprint, fp)
	}
	e.at(after.Add(e.h.TTL))
	next := e.won(k, e.long())
	if next.Fence != c.Fence+1 && next.Fence != 1 {
		t.Fatalf("claim at completion + ttl: fence %d, want %d (kept) or 1 (reaped)", next.Fence, c.Fence+1)
	}
}

// fpPlain: Complete stores no fingerprint, and a later CompleteFingerprint
// with the same fence finds the record done and adds none.
func fpPlain(t *testing.T, e *env) {
	f := e.fingerprinter()
	k := e.key()
	c := e.won(k, e.long())
	e.complete(c, true)
	e.doneWith(k, "")
	e.completeFP(f, c, "sha256:late", true)
	e.doneWith(k, "")
}

// fpRetried: a retried complete of the same claim, with the fingerprint it
// had or another one, or none, answers true and changes nothing: neither
// the fingerprint nor the end of the ttl.
func fpRetried(t *testing.T, e *env) {
	f := e.fingerprinter()
	k := e.key()
	c := e.won(k, e.long())
	e.completeFP(f, c, "first", true)
	first := e.doneWith(k, "first")
	e.pass(e.short())
	e.completeFP(f, c, "first", true)
	e.completeFP(f, c, "second", true)
	e.completeFP(f, c, "", true)
	e.complete(c, true)
	again := e.doneWith(k, "first")
	if !first.Until.IsZero() && !again.Until.IsZero() && !sameInstant(first.Until, again.Until) {
		t.Fatalf("AlreadyDone.Until moved from %v to %v: a retried complete restarted the ttl", first.Until, again.Until)
	}
}

// fpStale: a claim that was replaced, released, or never existed stores
// nothing: its CompleteFingerprint answers false, and the key's fingerprint
// is the one its current holder completes with.
func fpStale(t *testing.T, e *env) {
	f := e.fingerprinter()

	// Replaced: the zombie's fingerprint must not land on the newer claim.
	k := e.key()
	zombie := e.won(k, e.short())
	e.pass(e.short())
	fresh := e.won(k, e.long())
	e.completeFP(f, zombie, "zombie", false)
	e.expect(k, store.HeldByOther)
	e.complete(fresh, true)
	e.doneWith(k, "")
	e.completeFP(f, zombie, "zombie", false)
	e.doneWith(k, "")

	// Replaced, the newer claim completing with a fingerprint of its own.
	k = e.key()
	zombie = e.won(k, e.short())
	e.pass(e.short())
	fresh = e.won(k, e.long())
	e.completeFP(f, zombie, "zombie", false)
	e.completeFP(f, fresh, "fresh", true)
	e.completeFP(f, zombie, "zombie", false)
	e.doneWith(k, "fresh")

	// Released: the key is not done, and the next holder's plain complete
	// leaves it without a fingerprint.
	k = e.key()
	rel := e.won(k, e.long())
	e.release(rel)
	e.completeFP(f, rel, "released", false)
	next := e.won(k, e.long())
	if next.Fence != rel.Fence+2 {
		t.Fatalf("claim after release: fence %d, want %d", next.Fence, rel.Fence+2)
	}
	e.completeFP(f, rel, "released", false)
	e.expect(k, store.HeldByOther)
	e.complete(next, true)
	e.doneWith(k, "")
}

// fpReclaim: a done key reclaimed after its ttl starts without the
// fingerprint of its earlier life: its claims report none while it is held,
// and a plain complete leaves it without one.
func fpReclaim(t *testing.T, e *env) {
	f := e.fingerprinter()
	plain, other := e.key(), e.key()
	for _, k := range []string{plain, other} {
		c := e.won(k, e.long())
		e.completeFP(f, c, "earlier life", true)
		e.doneWith(k, "earlier life")
	}
	e.pass(e.h.TTL)

	next := e.won(plain, e.long()) // e.claim checks that Won reports none
	e.expect(plain, store.HeldByOther)
	e.complete(next, true)
	e.doneWith(plain, "")

	// A reclaim whose lease lapses, then a reclaim of that: still none.
	lapsed := e.won(other, e.short())
	e.pass(e.short())
	next = e.won(other, e.long())
	if next.Fence != lapsed.Fence+1 {
		t.Fatalf("reclaim after the lease lapsed: fence %d, want %d", next.Fence, lapsed.Fence+1)
	}
	e.completeFP(f, next, "this life", true)
	e.doneWith(other, "this life")
}

// fpInvalid: a fingerprint that no backend can store (longer than
// store.MaxFingerprintLen bytes, not valid UTF-8, or with a NUL byte) is
// refused with ErrInvalidFingerprint whatever the record holds, and the
// refused call changes nothing.
func fpInvalid(t *testing.T, e *env) {
	f := e.fingerprinter()
	bad := []string{
		strings.Repeat("f", store.MaxFingerprintLen+1),
		strings.Repeat("é", store.MaxFingerprintLen/2) + "x",
		"nul\x00byte",
		"invalid \xff UTF-8",
		"truncated \xe2\x82",
	}
	refuse := func(what string, c store.Claim) {
		t.Helper()
		for _, fp := range bad {
			ok, err := f.CompleteFingerprint(e.ctx, c, fp)
			if ok || !errors.Is(err, store.ErrInvalidFingerprint) {
				t.Fatalf("CompleteFingerprint(%s, %.20q... (%d bytes)) = %v, %v; want ErrInvalidFingerprint", what, fp, len(fp), ok, err)
			}
		}
	}
	k := e.key()
	c := e.won(k, e.long())
	refuse("a live claim", c)
	e.expect(k, store.HeldByOther) // not done
	ghost := store.Claim{Key: e.key(), Fence: 1, Token: "ghost", LeaseExpiry: e.h.Now().Add(time.Hour)}
	refuse("a claim on an absent key", ghost)
	if g := e.won(ghost.Key, e.long()); g.Fence != 1 {
		t.Fatalf("claim after refused calls on an absent key: fence %d, want 1", g.Fence)
	}
	e.completeFP(f, c, "valid", true)
	// Validation comes first: the record being done already changes nothing.
	refuse("a done claim", c)
	e.doneWith(k, "valid")
}

// fpVerbatim: fingerprints are stored byte for byte, up to
// store.MaxFingerprintLen bytes of any valid UTF-8 without NUL, each with
// its own key.
func fpVerbatim(t *testing.T, e *env) {
	f := e.fingerprinter()
	fps := []string{
		strings.Repeat("f", store.MaxFingerprintLen),
		strings.Repeat("f", store.MaxFingerprintLen-1) + "g",
		strings.Repeat("é", store.MaxFingerprintLen/2),
		strings.Repeat("🔑", store.MaxFingerprintLen/4),
		"sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
		"a",
		" padded ",
		"padded",
		"Case",
		"case",
		"caf\u00e9",
		"cafe\u0301",
		"tab\tnewline\ncontrol\x01\x1f\x7f",
		`quote' "; DROP TABLE records; -- %s \ {x}`,
		"\uFFFD",
	}
	keys := make([]string, len(fps))
	for i, fp := range fps {
		keys[i] = e.key()
		e.completeFP(f, e.won(keys[i], e.long()), fp, true)
	}
	for i, fp := range fps {
		r := e.expect(keys[i], store.AlreadyDone)
		if r.Fingerprint != fp {
			t.Errorf("fingerprint %d came back as %q (%d bytes), want %q (%d bytes)", i, r.Fingerprint, len(r.Fingerprint), fp, len(fp))
		}
	}
}

// fpLost: a CompleteFingerprint whose reply was lost is retried; the retry
// finds the record done with its fence and answers true, and the key keeps
// the fingerprint.
func fpLost(t *testing.T, e *env) {
	f := e.fingerprinter()
	faults := e.faults()
	k := e.key()
	c := e.won(k, e.long())
	faults.LoseNextReply()
	before := e.h.Now() // for expect's real-time guard, as in lostComplete
	ok, err := f.CompleteFingerprint(e.ctx, c, "lost")
	t.Logf("CompleteFingerprint with a lost reply: %v, %v", ok, err)
	if err == nil {
		if !ok {
			t.Fatalf("CompleteFingerprint of the current claim answered false after a lost reply")
		}
		e.done[k] = completion{c.Fence, before}
		e.doneWith(k, "lost")
	}
	e.retries("retried CompleteFingerprint", func() error {
		ok, err := f.CompleteFingerprint(e.ctx, c, "lost")
		if err == nil && !ok {
			t.Fatalf("retried CompleteFingerprint answered false: the record is done with this fence, or still claimed with it")
		}
		return err
	})
	if _, seen := e.done[k]; !seen {
		e.done[k] = completion{c.Fence, before}
	}
	e.doneWith(k, "lost")
}
