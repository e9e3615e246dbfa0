package redislock_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// A fingerprint is kept in the done record, byte for byte (commas,
// newlines and multi-byte characters included, up to MaxFingerprintLen),
// reported by every Claim that finds the key done, left alone by a second
// Complete of the same claim, and gone once the key is reclaimed: a
// Complete without one stores none.
func TestFingerprintIsKeptReportedAndClearedByAReclaim(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	ctx := t.Context()
	raw := prefixOf(b) + "k"
	fp := "sha256:a,b\nc,é"
	fp += strings.Repeat("x", store.MaxFingerprintLen-len(fp))

	r, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatal(r.Outcome, err)
	}
	if ok, err := b.CompleteFingerprint(ctx, r.Claim, fp); !ok || err != nil {
		t.Fatalf("complete: %v %v", ok, err)
	}
	if got := readRecord(t, c, raw); got.State != "d" || got.Fingerprint != fp || got.Fence != 1 {
		t.Fatalf("stored %+v, want done at fence 1 with the fingerprint", got)
	}
	for range 2 {
		got, err := b.Claim(ctx, "k", time.Minute)
		if err != nil || got.Outcome != store.AlreadyDone || got.Fingerprint != fp {
			t.Fatalf("claim of the done key: %v fingerprint %q %v; want already done with %q", got.Outcome, got.Fingerprint, err, fp)
		}
	}
	// Completing again (a retry, or a call with another fingerprint)
	// changes nothing.
	if ok, err := b.CompleteFingerprint(ctx, r.Claim, "other"); !ok || err != nil {
		t.Fatalf("second complete: %v %v", ok, err)
	}
	if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
		t.Fatalf("third complete: %v %v", ok, err)
	}
	if got, _ := b.Claim(ctx, "k", time.Minute); got.Fingerprint != fp {
		t.Fatalf("after completing again: fingerprint %q, want %q", got.Fingerprint, fp)
	}

	// The ttl ends (the done record's expires-at moved to now, by the
	// server's clock): the reclaim (at fence 2, or at 1 when Redis
	// deleted the key first) starts without one.
	if err := c.Eval(ctx, setAtNow, []string{raw}, "d", 0, 0).Err(); err != nil {
		t.Fatal(err)
	}
	r, err = b.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.Won || r.Claim.Fence > 2 || r.Fingerprint != "" {
		t.Fatalf("reclaim: %v fence %d fingerprint %q %v", r.Outcome, r.Claim.Fence, r.Fingerprint, err)
	}
	if got := readRecord(t, c, raw); got.Fingerprint != "" {
		t.Fatalf("the reclaimed record keeps fingerprint %q", got.Fingerprint)
	}
	if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
		t.Fatal(ok, err)
	}
	if got, _ := b.Claim(ctx, "k", time.Minute); got.Outcome != store.AlreadyDone || got.Fingerprint != "" {
		t.Fatalf("done without a fingerprint: %v %q", got.Outcome, got.Fingerprint)
	}
	// An empty fingerprint is none, the same record Complete writes.
	r, _ = b.Claim(ctx, "e", time.Minute)
	if ok, err := b.CompleteFingerprint(ctx, r.Claim, ""); !ok || err != nil {
		t.Fatal(ok, err)
	}
	plain, _ := b.Claim(ctx, "p", time.Minute)
	b.Complete(ctx, plain.Claim)
	e, p := readRecord(t, c, prefixOf(b)+"e"), readRecord(t, c, prefixOf(b)+"p")
	if e.Fingerprint != "" || p.Fingerprint != "" {
		t.Fatalf("fingerprints %q and %q, want none", e.Fingerprint, p.Fingerprint)
	}
}

// A fingerprint the port refuses is refused before any I/O, with
// ErrInvalidFingerprint, and a key the port refuses with ErrInvalidKey.
func TestCompleteFingerprintValidatesBeforeAnyIO(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	rt := &roundTrips{}
	c.AddHook(rt)
	b := newBackend(t, c)
	claim := store.Claim{Key: "k", Fence: 1, Token: store.NewToken()}
	for _, fp := range []string{strings.Repeat("x", store.MaxFingerprintLen+1), "a\x00b", "\xff"} {
		if ok, err := b.CompleteFingerprint(t.Context(), claim, fp); ok || !errors.Is(err, store.ErrInvalidFingerprint) {
			t.Errorf("fingerprint %q: %v %v, want ErrInvalidFingerprint", fp, ok, err)
		}
	}
	if _, err := b.CompleteFingerprint(t.Context(), store.Claim{Fence: 1}, "fp"); !errors.Is(err, store.ErrInvalidKey) {
		t.Errorf("empty key: %v, want ErrInvalidKey", err)
	}
	if n := rt.n.Load(); n != 0 {
		t.Fatalf("%d round trips for refused arguments, want none", n)
	}
}

// A CompleteFingerprint whose reply was lost is resent with the same
// fingerprint and finds its own completion: true, the fingerprint stored
// once, reported to the next delivery.
func TestCompleteFingerprintResentFindsItsOwnCompletion(t *testing.T) {
	r := newLossRig(t, byBackend, time.Hour)
	ctx := t.Context()
	mine, _ := r.b.Claim(ctx, "k", time.Minute)
	wait := r.loseNextReply(t, nil)
	ok, err := r.b.CompleteFingerprint(ctx, mine.Claim, "fp-1")
	wantResent(t, wait(), true)
	if !ok || err != nil {
		t.Fatalf("resent complete: %v %v; want true", ok, err)
	}
	if got, _ := r.other.Claim(ctx, "k", time.Minute); got.Outcome != store.AlreadyDone || got.Fingerprint != "fp-1" {
		t.Fatalf("after: %v fingerprint %q, want already done with fp-1", got.Outcome, got.Fingerprint)
	}
}

// A CompleteFingerprint that landed and lost its reply, resent after its
// done record was reaped and another caller created the key afresh, marks
// nothing done and stores no fingerprint on the newcomer's record: it
// returns an error.
func TestCompleteFingerprintResentAfterTheKeyWasRecreatedLeavesTheNewcomerAlone(t *testing.T) {
	const ttl = 200 * time.Millisecond
	var ok bool
	r, resent, newcomer, err := recreatedBeforeTheResend(t, byBackend, ttl, 0, func(r *lossRig, mine store.Claim) (err error) {
		ok, err = r.b.CompleteFingerprint(t.Context(), mine, "fp-mine")
		return err
	})
	wantResent(t, resent, true)
	if err == nil {
		t.Errorf("resent complete = %v, nil; want an error", ok)
	} else if !isDriverError(err) {
		t.Errorf("error %v does not wrap the driver's error", err)
	}
	if got := readRecord(t, r.raw, prefixOf(r.b)+"k"); got.State != "c" || got.Fingerprint != "" {
		t.Fatalf("the newcomer's record is %+v, want still claimed, no fingerprint", got)
	}
	if ok, err := r.other.CompleteFingerprint(t.Context(), newcomer, "fp-new"); !ok || err != nil {
		t.Fatalf("the newcomer's complete: %v %v", ok, err)
	}
	if got, _ := r.other.Claim(t.Context(), "k", time.Minute); got.Fingerprint != "fp-new" {
		t.Fatalf("fingerprint %q, want the newcomer's", got.Fingerprint)
	}
}

var _ store.Fingerprinter = (*redislock.Backend)(nil)
