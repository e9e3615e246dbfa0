package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Lock and Mutex hand a body's error back unchanged (errors.Is still sees
// a nested ErrDuplicate), release the claim, and let the caller tell the
// nested outcome from their own by the *DuplicateError's key.
func TestLockBodyErrorWrappingANestedOutcomeReleases(t *testing.T) {
	for _, verb := range []string{"Lock", "Mutex"} {
		t.Run(verb, func(t *testing.T) {
			s, _ := newStore(t)
			completeSubKey(t, s, "po:PO-1")
			call := idempotency.Lock
			if verb == "Mutex" {
				call = idempotency.Mutex
			}
			err := call(t.Context(), s, "m-1", func(ctx context.Context) error {
				return idempotency.Lock(ctx, s, "po:PO-1", func(context.Context) error { return nil })
			})
			var dup *idempotency.DuplicateError
			if !errors.Is(err, idempotency.ErrDuplicate) || !errors.As(err, &dup) || dup.Key != "po:PO-1" {
				t.Fatalf("err = %v, want the nested *DuplicateError for po:PO-1", err)
			}
			if idempotency.IsOwnDuplicate(err, "m-1") {
				t.Fatal("IsOwnDuplicate(err, m-1) = true for the body's nested duplicate")
			}
			assertReleased(t, s, "m-1")
			// Lock's own duplicate on a done key: a *DuplicateError with
			// that key and when suppression ends.
			err = idempotency.Lock(t.Context(), s, "po:PO-1", func(context.Context) error { t.Error("ran"); return nil })
			if !errors.As(err, &dup) || dup.Key != "po:PO-1" || dup.Until.IsZero() || !idempotency.IsOwnDuplicate(err, "po:PO-1") {
				t.Fatalf("own duplicate = %#v, want a *DuplicateError for po:PO-1 with Until", err)
			}
		})
	}
}

// A body can hand back an error that looks like Lock's own duplicate on
// the very key Lock holds: one it built itself, or one a nested Lock on
// the same key returned from another backend, wrapped. The body ran and
// failed, Lock released the key, so IsOwnDuplicate must say no, or the
// caller acks a failed delivery.
func TestIsOwnDuplicateIsNotForgedByTheBody(t *testing.T) {
	other, _ := newStore(t)
	completeSubKey(t, other, "m-1")
	forged := map[string]func(ctx context.Context) error{
		"built": func(context.Context) error { return &idempotency.DuplicateError{Key: "m-1"} },
		"wrapped nested Lock on another backend": func(ctx context.Context) error {
			err := idempotency.Lock(ctx, other, "m-1", func(context.Context) error { return nil })
			return fmt.Errorf("legacy store: %w", err)
		},
	}
	for name, body := range forged {
		t.Run(name, func(t *testing.T) {
			s, _ := newStore(t)
			err := idempotency.Lock(t.Context(), s, "m-1", body)
			if !errors.Is(err, idempotency.ErrDuplicate) {
				t.Fatalf("err = %v: Lock must still hand the body's error back unchanged", err)
			}
			if idempotency.IsOwnDuplicate(err, "m-1") {
				t.Fatalf("IsOwnDuplicate(%v, m-1) = true for a body's failure: the caller would ack it", err)
			}
			assertReleased(t, s, "m-1")
		})
	}
}

// waitExtends blocks until the store has seen n more Extend calls.
func waitExtends(t *testing.T, s *fake.Store, n int) {
	t.Helper()
	want := s.Calls(fake.OpExtend) + n
	deadline := time.Now().Add(10 * time.Second)
	for s.Calls(fake.OpExtend) < want {
		if time.Now().After(deadline) {
			t.Fatalf("no heartbeat: %d Extend calls, want %d", s.Calls(fake.OpExtend), want)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestHeartbeatKeepsWorkThatOutrunsItsLeaseFromBeingReclaimed(t *testing.T) {
	s, clock := newStore(t)
	ctx := t.Context()
	err := idempotency.Lock(ctx, s, "long", func(ctx context.Context) error {
		// Six minutes of work on a one-minute lease, renewed as it goes.
		for range 12 {
			clock.Advance(30 * time.Second)
			waitExtends(t, s, 1)
		}
		if err := idempotency.Lock(ctx, s, "long", func(context.Context) error {
			t.Error("a redelivery took the key from live work")
			return nil
		}); !errors.Is(err, idempotency.ErrInProgress) {
			t.Errorf("redelivery during the work: %v, want ErrInProgress", err)
		}
		return nil
	}, idempotency.WithLease(time.Minute), idempotency.WithHeartbeat(idempotency.MinHeartbeat))
	if err != nil {
		t.Fatal(err)
	}
	if rec, _ := s.Record("long"); rec.State != store.Done || rec.Fence != 1 {
		t.Fatalf("record %+v, want done with fence 1", rec)
	}
}

func TestHeartbeatCancelsTheBodyWhenTheClaimIsLost(t *testing.T) {
	s, clock := newStore(t)
	l, logger := newLogs()
	ctx := t.Context()
	var cause error
	err := idempotency.Lock(ctx, s, "lost", func(ctx context.Context) error {
		// The renewals fail (say the store is unreachable) until the lease
		// lapses and another delivery takes the key.
		for range 3 {
			s.FailNext(fake.OpExtend, errors.New("unavailable"))
		}
		waitExtends(t, s, 3)
		clock.Advance(2 * time.Minute)
		if r, _ := s.Claim(context.Background(), "lost", time.Hour); r.Outcome != store.Won {
			t.Errorf("the takeover: %v", r.Outcome)
		}
		<-ctx.Done()
		cause = context.Cause(ctx)
		return ctx.Err()
	}, idempotency.WithLease(time.Minute), idempotency.WithHeartbeat(idempotency.MinHeartbeat), idempotency.WithLogger(logger))
	if !errors.Is(err, context.Canceled) || !errors.Is(cause, store.ErrLost) {
		t.Fatalf("err = %v, cause = %v; want the body cancelled because the claim was lost", err, cause)
	}
	if len(l.find(t, "WARN", "renewal failed")) < 3 || len(l.find(t, "ERROR", "claim was lost")) != 1 {
		t.Fatalf("logs: %v", l.records(t))
	}
	if rec, _ := s.Record("lost"); rec.Fence != 2 || rec.State != store.Claimed {
		t.Fatalf("record %+v: the new holder's claim must stand", rec)
	}
}

func TestHeartbeatCompletesWithTheRenewedClaim(t *testing.T) {
	// A backend that changes the claim on each renewal (as Datastore's
	// version does) must be completed with the latest one.
	s := fake.New()
	var extended store.Claim
	b := extendingBackend{Store: s, seen: &extended}
	err := idempotency.Lock(t.Context(), b, "k", func(context.Context) error {
		waitExtends(t, s, 2)
		return nil
	}, idempotency.WithHeartbeat(idempotency.MinHeartbeat))
	if err != nil {
		t.Fatal(err)
	}
	if rec, _ := s.Record("k"); rec.State != store.Done {
		t.Fatalf("record %+v", rec)
	}
}

// extendingBackend bumps Rev on every Extend and insists Complete gets the
// latest Rev.
type extendingBackend struct {
	*fake.Store
	seen *store.Claim
}

func (b extendingBackend) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	c, err := b.Store.Extend(ctx, c, lease)
	c.Rev++
	*b.seen = c
	return c, err
}

func (b extendingBackend) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return b.CompleteFingerprint(ctx, c, "")
}

// CompleteFingerprint overrides the fake's, which the embedding would
// otherwise promote past the check.
func (b extendingBackend) CompleteFingerprint(ctx context.Context, c store.Claim, fp string) (bool, error) {
	if c.Rev != b.seen.Rev {
		return false, errors.New("completed with a stale claim")
	}
	return b.Store.CompleteFingerprint(ctx, c, fp)
}

func TestHeartbeatIsIgnoredWithAWarningWithoutExtender(t *testing.T) {
	s := fake.New()
	l, logger := newLogs()
	b := backendFunc{claim: s.Claim, complete: s.Complete, release: s.Release}
	if err := idempotency.Lock(t.Context(), b, "k", func(context.Context) error { return nil },
		idempotency.WithHeartbeat(time.Second), idempotency.WithLogger(logger)); err != nil {
		t.Fatal(err)
	}
	if len(l.find(t, "WARN", "WithHeartbeat ignored")) != 1 {
		t.Fatalf("logs: %v", l.records(t))
	}
}

// A body that outlives its request (the push deadline passed, or Cloud Run
// cut the request) is still doing the work: the heartbeat must keep its
// claim until the body returns, or a redelivery takes the key once the
// short lease lapses and runs the work a second time beside it.
func TestHeartbeatKeepsRenewingUntilTheBodyReturnsEvenAfterTheRequestEnds(t *testing.T) {
	s, clock := newStore(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var second int
	err := idempotency.Lock(ctx, s, "outlived", func(bctx context.Context) error {
		cancel() // the request ends; this body does not watch its context
		for range 6 {
			clock.Advance(30 * time.Second)
			want := s.Calls(fake.OpExtend) + 1
			for deadline := time.Now().Add(2 * time.Second); s.Calls(fake.OpExtend) < want && time.Now().Before(deadline); {
				time.Sleep(time.Millisecond)
			}
		}
		// Three minutes on, a redelivery arrives.
		if err := idempotency.Lock(t.Context(), s, "outlived", func(context.Context) error {
			second++
			return nil
		}); !errors.Is(err, idempotency.ErrInProgress) {
			t.Errorf("redelivery while the first body still runs: %v, want ErrInProgress", err)
		}
		return nil
	}, idempotency.WithLease(time.Minute), idempotency.WithHeartbeat(idempotency.MinHeartbeat))
	if err != nil {
		t.Fatal(err)
	}
	if second != 0 {
		t.Fatalf("the work ran %d more time(s) while the first body still ran", second)
	}
	if rec, _ := s.Record("outlived"); rec.State != store.Done || rec.Fence != 1 {
		t.Fatalf("record %+v, want done by the first holder (fence 1)", rec)
	}
}

func TestLockRedeliveryIsADuplicate(t *testing.T) {
	s, _ := newStore(t)
	ctx := t.Context()
	runs := 0
	body := func(context.Context) error { runs++; return nil }

	if err := idempotency.Lock(ctx, s, "msg-1", body); err != nil {
		t.Fatalf("first delivery: %v", err)
	}
	err := idempotency.Lock(ctx, s, "msg-1", body)
	if !errors.Is(err, idempotency.ErrDuplicate) {
		t.Fatalf("redelivery: err = %v, want ErrDuplicate", err)
	}
	if !strings.Contains(err.Error(), `"msg-1"`) {
		t.Errorf("duplicate error %q does not name the key", err)
	}
	if runs != 1 {
		t.Fatalf("body ran %d times, want 1", runs)
	}
	if rec, _ := s.Record("msg-1"); rec.State != store.Done || rec.Fence != 1 {
		t.Fatalf("record %+v, want done with fence 1", rec)
	}
}

func TestLockConcurrentSameKeyAdmitsOneBody(t *testing.T) {
	s, _ := newStore(t)
	ctx := t.Context()
	const n = 32
	var (
		runs    atomic.Int32
		release = make(chan struct{})
		results = make(chan error, n)
		start   = make(chan struct{})
	)
	body := func(context.Context) error {
		runs.Add(1)
		<-release // hold the key until every other racer has given up
		return nil
	}
	for range n {
		go func() {
			<-start
			results <- idempotency.Lock(ctx, s, "msg-race", body)
		}()
	}
	close(start)
	// The winner cannot return before release closes, so the first n-1
	// results are the losers'.
	for range n - 1 {
		if err := <-results; !errors.Is(err, idempotency.ErrInProgress) {
			t.Errorf("loser: err = %v, want ErrInProgress", err)
		}
	}
	close(release)
	if err := <-results; err != nil {
		t.Fatalf("winner: %v", err)
	}
	if runs.Load() != 1 {
		t.Fatalf("body ran %d times, want 1", runs.Load())
	}
	// The refused deliveries come back later and find the key done.
	if err := idempotency.Lock(ctx, s, "msg-race", body); !errors.Is(err, idempotency.ErrDuplicate) {
		t.Fatalf("retry after the winner finished: %v, want ErrDuplicate", err)
	}
}

func TestLockTransientFailureReleasesAndTheRetrySucceedsOnce(t *testing.T) {
	s, _ := newStore(t)
	ctx := t.Context()
	transient := errors.New("supplier timed out")
	attempts, sends := 0, 0
	body := func(context.Context) error {
		attempts++
		if attempts == 1 {
			return transient
		}
		sends++
		return nil
	}
	err := idempotency.Lock(ctx, s, "msg-2", body)
	if err != transient {
		t.Fatalf("failed body: err = %v, want the body's own error unchanged", err)
	}
	rec, _ := s.Record("msg-2")
	if rec.State != store.Claimed || rec.Fence != 2 || !rec.LeaseExpiry.Equal(epoch) {
		t.Fatalf("after the failure the record is %+v; want released (fence 2, lease expired now)", rec)
	}
	// The redelivery reclaims at once: no waiting for the lease.
	if err := idempotency.Lock(ctx, s, "msg-2", body); err != nil {
		t.Fatalf("redelivery: %v", err)
	}
	if err := idempotency.Lock(ctx, s, "msg-2", body); !errors.Is(err, idempotency.ErrDuplicate) {
		t.Fatalf("third delivery: %v, want ErrDuplicate", err)
	}
	if sends != 1 || attempts != 2 {
		t.Fatalf("attempts=%d sends=%d, want 2 and 1", attempts, sends)
	}
}

func TestLockCrashedHolderSelfHealsAfterTheLease(t *testing.T) {
	s, clock := newStore(t)
	ctx := t.Context()
	// A holder claims and dies: no Complete, no Release.
	if _, err := s.Claim(ctx, "msg-3", store.DefaultLease); err != nil {
		t.Fatal(err)
	}
	runs := 0
	body := func(context.Context) error { runs++; return nil }
	err := idempotency.Lock(ctx, s, "msg-3", body)
	var ip *idempotency.InProgressError
	if !errors.As(err, &ip) || !ip.Until.Equal(epoch.Add(store.DefaultLease)) {
		t.Fatalf("while the dead holder's lease is live: err = %v, want InProgressError until %v", err, epoch.Add(store.DefaultLease))
	}
	clock.Advance(store.DefaultLease)
	if err := idempotency.Lock(ctx, s, "msg-3", body); err != nil {
		t.Fatalf("after the lease lapsed: %v", err)
	}
	if rec, _ := s.Record("msg-3"); runs != 1 || rec.State != store.Done || rec.Fence != 2 {
		t.Fatalf("runs=%d record=%+v; want 1 run, done, fence 2", runs, rec)
	}
}

func TestLockRecordsDoneWhenWorkOutrunsAnUnreclaimedLease(t *testing.T) {
	s, clock := newStore(t)
	ctx := t.Context()
	l, logger := newLogs()
	err := idempotency.Lock(ctx, s, "msg-4", func(context.Context) error {
		clock.Advance(time.Hour) // far past the 1-minute lease; nobody else came
		return nil
	}, idempotency.WithLease(time.Minute), idempotency.WithLogger(logger))
	if err != nil {
		t.Fatal(err)
	}
	if err := idempotency.Lock(ctx, s, "msg-4", func(context.Context) error {
		t.Error("the redelivery ran the body again")
		return nil
	}); !errors.Is(err, idempotency.ErrDuplicate) {
		t.Fatalf("redelivery: %v, want ErrDuplicate", err)
	}
	if e := l.find(t, "ERROR", ""); len(e) != 0 {
		t.Fatalf("unexpected error logs: %v", e)
	}
}

func TestLockAcksAndLogsWhenFencedOutByAReclaim(t *testing.T) {
	s, clock := newStore(t)
	ctx := t.Context()
	l, logger := newLogs()
	sends := 0
	err := idempotency.Lock(ctx, s, "msg-5", func(context.Context) error {
		sends++
		clock.Advance(2 * time.Minute) // outran the lease...
		// ...and a redelivery reclaimed the key and ran the work too.
		if err := idempotency.Lock(ctx, s, "msg-5", func(context.Context) error { sends++; return nil }); err != nil {
			t.Errorf("reclaiming delivery: %v", err)
		}
		return nil
	}, idempotency.WithLease(time.Minute), idempotency.WithLogger(logger))
	if err != nil {
		t.Fatalf("fenced-out holder: err = %v, want nil (ack: the send happened)", err)
	}
	recs := l.find(t, "ERROR", "fenced out")
	if len(recs) != 1 || recs[0]["key"] != "msg-5" || recs[0]["fence"] != float64(1) {
		t.Fatalf("want one error log naming key msg-5 and fence 1; got %v", l.records(t))
	}
	if rec, _ := s.Record("msg-5"); rec.State != store.Done || rec.Fence != 2 {
		t.Fatalf("record %+v: the reclaimer's completion must stand", rec)
	}
	if sends != 2 {
		t.Fatalf("sends = %d; the reclaimer re-ran the work, which only a longer lease prevents", sends)
	}
}

func TestLockAcksAndLogsWhenCompleteFails(t *testing.T) {
	s, _ := newStore(t)
	l, logger := newLogs()
	b := backendFunc{claim: s.Claim, release: s.Release,
		complete: func(context.Context, store.Claim) (bool, error) {
			return false, errors.New("datastore unavailable")
		}}
	sent := false
	err := idempotency.Lock(t.Context(), b, "msg-6", func(context.Context) error {
		sent = true
		return nil
	}, idempotency.WithLogger(logger), idempotency.WithSettleTimeout(200*time.Millisecond))
	if err != nil || !sent {
		t.Fatalf("err = %v sent = %v; want nil (ack) after the send", err, sent)
	}
	recs := l.find(t, "ERROR", "marking the key done failed")
	if len(recs) != 1 || !strings.Contains(recs[0]["error"].(string), "datastore unavailable") {
		t.Fatalf("want one error log carrying the store error; got %v", l.records(t))
	}
}

// A Complete that fails once (a dropped connection, a busy server) must be
// tried again within the settle timeout: a key left Claimed after the work
// ran is reclaimed when its lease lapses, and a producer's republish or a
// second subscription's copy then runs the work again.
func TestLockRetriesATransientCompleteFailure(t *testing.T) {
	s, clock := newStore(t)
	l, logger := newLogs()
	s.FailNext(fake.OpComplete, errors.New("connection reset"))
	runs := 0
	body := func(context.Context) error { runs++; return nil }
	if err := idempotency.Lock(t.Context(), s, "msg-6b", body, idempotency.WithLogger(logger)); err != nil {
		t.Fatal(err)
	}
	if rec, _ := s.Record("msg-6b"); rec.State != store.Done {
		t.Fatalf("record %+v: one failed Complete left the key claimed", rec)
	}
	clock.Advance(store.DefaultLease + time.Minute)
	if err := idempotency.Lock(t.Context(), s, "msg-6b", body); !errors.Is(err, idempotency.ErrDuplicate) {
		t.Fatalf("a republish after the lease: %v, want ErrDuplicate", err)
	}
	if runs != 1 {
		t.Fatalf("runs = %d, want 1", runs)
	}
	if recs := l.find(t, "ERROR", "marking the key done failed"); len(recs) != 0 {
		t.Fatalf("a retried Complete that succeeded logged an error: %v", recs)
	}
}

func TestLockCompletesOnAContextDetachedFromTheRequest(t *testing.T) {
	s, _ := newStore(t)
	ctx, cancel := context.WithCancel(t.Context())
	err := idempotency.Lock(ctx, s, "msg-7", func(context.Context) error {
		cancel() // the request ends the moment the work ends
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if rec, _ := s.Record("msg-7"); rec.State != store.Done {
		t.Fatalf("record %+v: the completion was lost to the cancellation", rec)
	}
}

func TestLockBoundsTheSettleCallWithItsOwnDeadline(t *testing.T) {
	s := fake.New()
	var got time.Duration
	var gotErr error
	b := backendFunc{
		claim: s.Claim,
		complete: func(ctx context.Context, c store.Claim) (bool, error) {
			dl, ok := ctx.Deadline()
			if !ok {
				t.Error("Complete ran without a deadline")
			}
			got, gotErr = time.Until(dl), ctx.Err()
			return s.Complete(ctx, c)
		},
		release: s.Release,
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	err := idempotency.Lock(ctx, b, "msg-8", func(context.Context) error { cancel(); return nil },
		idempotency.WithSettleTimeout(3*time.Second))
	if err != nil || gotErr != nil {
		t.Fatalf("err = %v, settle ctx err = %v", err, gotErr)
	}
	if got <= 0 || got > 3*time.Second {
		t.Fatalf("settle deadline %v away, want within 3s", got)
	}
}

func TestLockPanicReleasesThenRepanics(t *testing.T) {
	s, _ := newStore(t)
	func() {
		defer func() {
			if p := recover(); p != "boom" {
				t.Fatalf("recovered %v, want the body's panic value", p)
			}
		}()
		idempotency.Lock(t.Context(), s, "msg-9", func(context.Context) error { panic("boom") })
		t.Fatal("Lock returned after a panicking body")
	}()
	rec, _ := s.Record("msg-9")
	if rec.State != store.Claimed || rec.Fence != 2 || !rec.LeaseExpiry.Equal(epoch) {
		t.Fatalf("record %+v: want released (fence 2, lease expired)", rec)
	}
}

func TestLockGoexitReleases(t *testing.T) {
	s, _ := newStore(t)
	done := make(chan struct{})
	go func() {
		defer close(done)
		idempotency.Lock(context.Background(), s, "msg-10", func(context.Context) error {
			runtime.Goexit()
			return nil
		})
	}()
	<-done
	if rec, _ := s.Record("msg-10"); rec.Fence != 2 || rec.State != store.Claimed {
		t.Fatalf("record %+v: want released", rec)
	}
}

func TestLockReleaseFailureStillReturnsTheBodysError(t *testing.T) {
	s, _ := newStore(t)
	l, logger := newLogs()
	b := backendFunc{claim: s.Claim, complete: s.Complete,
		release: func(context.Context, store.Claim) error { return errors.New("network down") }}
	bodyErr := errors.New("body failed")
	err := idempotency.Lock(t.Context(), b, "msg-11", func(context.Context) error { return bodyErr },
		idempotency.WithLogger(logger), idempotency.WithSettleTimeout(200*time.Millisecond))
	if err != bodyErr {
		t.Fatalf("err = %v, want the body's error", err)
	}
	if len(l.find(t, "WARN", "release failed")) != 1 {
		t.Fatalf("want a warning about the failed release; got %v", l.records(t))
	}
}

// One failed Release (a dropped reply) must not leave a failed delivery's
// key held for a whole lease: its redeliveries would be refused with 503
// until then, each one spending a delivery attempt towards the dead-letter
// topic.
func TestLockRetriesATransientReleaseFailure(t *testing.T) {
	s, _ := newStore(t)
	s.FailNext(fake.OpRelease, errors.New("network down"))
	bodyErr := errors.New("body failed")
	if err := idempotency.Lock(t.Context(), s, "msg-11b", func(context.Context) error { return bodyErr }); err != bodyErr {
		t.Fatalf("err = %v, want the body's error", err)
	}
	if rec, _ := s.Record("msg-11b"); rec.Fence != 2 || rec.State != store.Claimed {
		t.Fatalf("record %+v: want released (fence 2) despite one failed Release", rec)
	}
}

func TestLockTTLExpiryMakesTheKeyReclaimable(t *testing.T) {
	s, clock := newStore(t)
	ctx := t.Context()
	runs := 0
	body := func(context.Context) error { runs++; return nil }
	idempotency.Lock(ctx, s, "msg-12", body)
	clock.Advance(s.TTL() - time.Second)
	if err := idempotency.Lock(ctx, s, "msg-12", body); !errors.Is(err, idempotency.ErrDuplicate) {
		t.Fatalf("within the ttl: %v", err)
	}
	clock.Advance(time.Second)
	if err := idempotency.Lock(ctx, s, "msg-12", body); err != nil {
		t.Fatalf("after the ttl: %v", err)
	}
	if rec, _ := s.Record("msg-12"); runs != 2 || rec.Fence != 2 {
		t.Fatalf("runs=%d fence=%d, want 2 and 2", runs, rec.Fence)
	}
}

// The body's context, which carries the claim in one allocation (and,
// without a heartbeat, no cancel context of its own), still is the
// caller's: its values, deadline and cancellation, with the claim of the
// innermost Lock for ClaimFrom.
func TestBodyContextIsTheCallersWithTheClaim(t *testing.T) {
	s, _ := newStore(t)
	type ctxKey struct{}
	deadline := time.Now().Add(time.Hour)
	parent, cancel := context.WithDeadline(context.WithValue(t.Context(), ctxKey{}, "v"), deadline)
	defer cancel()
	err := idempotency.Lock(parent, s, "outer", func(ctx context.Context) error {
		if ctx.Value(ctxKey{}) != "v" {
			return fmt.Errorf("caller's value lost: %v", ctx.Value(ctxKey{}))
		}
		if dl, ok := ctx.Deadline(); !ok || !dl.Equal(deadline) {
			return fmt.Errorf("deadline %v %v, want %v", dl, ok, deadline)
		}
		if c, ok := idempotency.ClaimFrom(ctx); !ok || c.Key != "outer" {
			return fmt.Errorf("outer ClaimFrom = %+v, %v", c, ok)
		}
		if err := idempotency.Lock(ctx, s, "inner", func(ictx context.Context) error {
			if c, ok := idempotency.ClaimFrom(ictx); !ok || c.Key != "inner" {
				return fmt.Errorf("inner ClaimFrom = %+v, %v", c, ok)
			}
			if ictx.Value(ctxKey{}) != "v" {
				return errors.New("caller's value lost in the inner body")
			}
			return nil
		}); err != nil {
			return err
		}
		if c, _ := idempotency.ClaimFrom(ctx); c.Key != "outer" {
			return fmt.Errorf("after the inner Lock, ClaimFrom = %+v", c)
		}
		cancel()
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Second):
			return errors.New("the caller's cancellation did not reach the body")
		}
		if !errors.Is(ctx.Err(), context.Canceled) {
			return fmt.Errorf("body ctx.Err() = %v after the caller cancelled", ctx.Err())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if rec, _ := s.Record("outer"); rec.State != store.Done {
		t.Fatalf("outer key %v, want done: Complete must not follow the caller's cancellation", rec.State)
	}
}

func TestLockPassesTheClaimToTheBody(t *testing.T) {
	s, clock := newStore(t)
	s.Claim(t.Context(), "msg-13", time.Minute) // an earlier holder whose lease lapses: fence 1
	clock.Advance(time.Minute)
	var got store.Claim
	var ok bool
	idempotency.Lock(t.Context(), s, "msg-13", func(ctx context.Context) error {
		got, ok = idempotency.ClaimFrom(ctx)
		return nil
	})
	if !ok || got.Key != "msg-13" || got.Fence != 2 {
		t.Fatalf("ClaimFrom = %+v, %v; want key msg-13 fence 2", got, ok)
	}
	if _, ok := idempotency.ClaimFrom(t.Context()); ok {
		t.Fatal("ClaimFrom found a claim outside a body")
	}
}

func TestLockRefusesBadArguments(t *testing.T) {
	s, _ := newStore(t)
	ctx := t.Context()
	noop := func(context.Context) error { return nil }
	if err := idempotency.Lock(ctx, s, "k", noop, idempotency.WithLease(0)); !errors.Is(err, store.ErrInvalidLease) {
		t.Errorf("lease 0: %v", err)
	}
	if err := idempotency.Lock(ctx, s, "", noop); !errors.Is(err, store.ErrInvalidKey) {
		t.Errorf("empty key: %v", err)
	}
	if err := idempotency.Lock(ctx, nil, "k", noop); err == nil {
		t.Error("nil backend: no error")
	}
	if err := idempotency.Mutex(ctx, s, "k", nil); err == nil {
		t.Error("nil body: no error")
	}
	if err := idempotency.Lock(ctx, s, "k", noop, idempotency.WithSettleTimeout(-1)); err == nil {
		t.Error("negative settle timeout: no error")
	}
	if s.Len() != 0 {
		t.Fatalf("refused calls left %d records", s.Len())
	}
}

func TestLockWrapsClaimErrors(t *testing.T) {
	s, _ := newStore(t)
	boom := errors.New("connection refused")
	s.FailNext(fake.OpClaim, boom)
	ran := false
	err := idempotency.Lock(t.Context(), s, "k", func(context.Context) error { ran = true; return nil })
	if !errors.Is(err, boom) || ran {
		t.Fatalf("err = %v ran = %v; want the claim error wrapped and no run", err, ran)
	}
}

func TestLockWarnsWhenTheRequestCanOutliveTheLease(t *testing.T) {
	s := fake.New()
	l, logger := newLogs()
	ctx, cancel := context.WithTimeout(t.Context(), time.Hour)
	defer cancel()
	idempotency.Lock(ctx, s, "k", func(context.Context) error { return nil },
		idempotency.WithLease(time.Minute), idempotency.WithLogger(logger))
	if len(l.find(t, "WARN", "outlive its lease")) != 1 {
		t.Fatalf("want a lease-sizing warning; got %v", l.records(t))
	}
}

func TestMutexRunsEveryMessageAndNeverMarksDone(t *testing.T) {
	s, _ := newStore(t)
	ctx := t.Context()
	var applied []int
	for i := range 3 {
		err := idempotency.Mutex(ctx, s, "po:PO-1", func(context.Context) error {
			applied = append(applied, i)
			return nil
		})
		if err != nil {
			t.Fatalf("update %d: %v", i, err)
		}
		rec, _ := s.Record("po:PO-1")
		if rec.State != store.Claimed || rec.Fence != int64(2*(i+1)) {
			t.Fatalf("after update %d: record %+v; want claimed (released), fence %d", i, rec, 2*(i+1))
		}
	}
	if fmt.Sprint(applied) != "[0 1 2]" {
		t.Fatalf("applied %v, want every update", applied)
	}
}

func TestMutexConcurrentMessageIsInProgress(t *testing.T) {
	s, _ := newStore(t)
	ctx := t.Context()
	err := idempotency.Mutex(ctx, s, "po:PO-2", func(context.Context) error {
		inner := idempotency.Mutex(ctx, s, "po:PO-2", func(context.Context) error {
			t.Error("two bodies ran at once")
			return nil
		})
		if !errors.Is(inner, idempotency.ErrInProgress) {
			t.Errorf("concurrent message: %v, want ErrInProgress", inner)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestMutexReturnsTheBodysErrorAndReleases(t *testing.T) {
	s, _ := newStore(t)
	bad := errors.New("bad update")
	if err := idempotency.Mutex(t.Context(), s, "po:PO-3", func(context.Context) error { return bad }); err != bad {
		t.Fatalf("err = %v", err)
	}
	if err := idempotency.Mutex(t.Context(), s, "po:PO-3", func(context.Context) error { return nil }); err != nil {
		t.Fatalf("next message after a failure: %v", err)
	}
}

func TestMutexOnAKeyCompletedByLockIsInProgress(t *testing.T) {
	s, _ := newStore(t)
	ctx := t.Context()
	idempotency.Lock(ctx, s, "po:PO-4", func(context.Context) error { return nil })
	err := idempotency.Mutex(ctx, s, "po:PO-4", func(context.Context) error {
		t.Error("Mutex ran over a completed key")
		return nil
	})
	var ip *idempotency.InProgressError
	if !errors.As(err, &ip) || !ip.Done || !strings.Contains(err.Error(), "completed by Lock") {
		t.Fatalf("err = %v, want an InProgressError saying the key is done", err)
	}
}

func TestMutexReleaseFailureIsLoggedNotReturned(t *testing.T) {
	s, _ := newStore(t)
	l, logger := newLogs()
	b := backendFunc{claim: s.Claim, complete: s.Complete,
		release: func(context.Context, store.Claim) error { return errors.New("network down") }}
	err := idempotency.Mutex(t.Context(), b, "po:PO-5", func(context.Context) error { return nil },
		idempotency.WithLogger(logger), idempotency.WithSettleTimeout(200*time.Millisecond))
	if err != nil {
		t.Fatalf("err = %v: the update was applied, reporting failure would apply it again", err)
	}
	if len(l.find(t, "WARN", "release failed")) != 1 {
		t.Fatalf("want a warning; got %v", l.records(t))
	}
}

func TestInProgressErrorSaysUntilWhen(t *testing.T) {
	err := error(&idempotency.InProgressError{Key: "k", Until: epoch})
	if !errors.Is(err, idempotency.ErrInProgress) || errors.Is(err, idempotency.ErrDuplicate) {
		t.Fatal("errors.Is mismatch")
	}
	if want := `idempotency: key "k" is held by another delivery until 2026-11-29T12:00:00Z`; err.Error() != want {
		t.Fatalf("Error() = %q, want %q", err, want)
	}
	if got := (&idempotency.InProgressError{Key: "k"}).Error(); got != `idempotency: key "k" is held by another delivery` {
		t.Fatalf("Error() without Until = %q", got)
	}
}

// Complete and Release are retried until the settle timeout, so a retry
// may follow an attempt that took effect but whose reply was lost. The
// retried Complete finds its own completion (no "fenced out" or "failed"
// error log; the redelivery is a duplicate); the retried Release changes
// nothing more (the fence rose once; the redelivery runs once).
func TestLockSettleRetryAfterALostReplyFindsItsOwnEffect(t *testing.T) {
	t.Run("Complete", func(t *testing.T) {
		s, clock := newStore(t)
		l, logger := newLogs()
		runs := 0
		body := func(context.Context) error {
			runs++
			s.LoseNextReply() // the next call is the Complete after this body
			return nil
		}
		if err := idempotency.Lock(t.Context(), s, "m", body, idempotency.WithLogger(logger)); err != nil {
			t.Fatal(err)
		}
		if n := s.Calls(fake.OpComplete); n != 2 {
			t.Fatalf("Complete called %d times, want 2 (the lost reply, then the retry)", n)
		}
		if e := l.find(t, "ERROR", ""); len(e) != 0 {
			t.Fatalf("error logs %v after a retried Complete found its own completion", e)
		}
		clock.Advance(store.DefaultLease + time.Minute)
		if err := idempotency.Lock(t.Context(), s, "m", body); !errors.Is(err, idempotency.ErrDuplicate) || runs != 1 {
			t.Fatalf("redelivery after the lease: %v, runs %d; want ErrDuplicate and 1 run", err, runs)
		}
	})
	t.Run("Release", func(t *testing.T) {
		s, _ := newStore(t)
		boom := errors.New("boom")
		err := idempotency.Lock(t.Context(), s, "m", func(context.Context) error {
			s.LoseNextReply() // the next call is the Release after this body
			return boom
		}, idempotency.WithLogger(newDiscard()))
		if err != boom {
			t.Fatalf("err = %v, want the body's error as is", err)
		}
		if n := s.Calls(fake.OpRelease); n != 2 {
			t.Fatalf("Release called %d times, want 2", n)
		}
		assertReleased(t, s, "m")
		runs := 0
		if err := idempotency.Lock(t.Context(), s, "m", func(context.Context) error { runs++; return nil }); err != nil || runs != 1 {
			t.Fatalf("redelivery: %v, runs %d; want nil and 1 run", err, runs)
		}
	})
}

// leaseRecorder is a fake store that records the lease of every Claim.
type leaseRecorder struct {
	*fake.Store
	mu     sync.Mutex
	leases []time.Duration
}

func (r *leaseRecorder) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	r.mu.Lock()
	r.leases = append(r.leases, lease)
	r.mu.Unlock()
	return r.Store.Claim(ctx, key, lease)
}

// last is the lease of the latest Claim.
func (r *leaseRecorder) last(t *testing.T) time.Duration {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.leases) == 0 {
		t.Fatal("no Claim")
	}
	return r.leases[len(r.leases)-1]
}

// deadlineClock is a fake store and clock that start at a real instant,
// so that a context deadline measured on the clock is a live one.
func deadlineClock(t *testing.T) (*leaseRecorder, *fake.Clock, time.Time) {
	t.Helper()
	start := time.Now().Truncate(time.Second)
	clock := fake.NewClock(start)
	return &leaseRecorder{Store: fake.New(fake.WithClock(clock.Now))}, clock, start
}

// WithLeaseFromDeadline: the lease is the time left until ctx's deadline,
// by the injected clock, + the settle timeout + the margin; without a
// deadline it is WithLease's. It is never shorter than the time left,
// never non-positive, and saturates for a far deadline.
func TestLeaseFromDeadlineIsTheTimeLeftPlusSettlePlusMargin(t *testing.T) {
	for _, c := range []struct {
		name     string
		deadline time.Duration // from start; 0: none, -1: in 400 years
		now      time.Duration // the injected clock, from start
		opts     []idempotency.LockOption
		want     time.Duration
	}{
		{name: "30s left", deadline: 30 * time.Second, want: 45 * time.Second},
		{name: "deadline beyond WithLease", deadline: time.Hour, opts: []idempotency.LockOption{idempotency.WithLease(15 * time.Minute)},
			want: time.Hour + 15*time.Second},
		{name: "no deadline", opts: []idempotency.LockOption{idempotency.WithLease(2 * time.Minute)}, want: 2 * time.Minute},
		{name: "deadline passed", deadline: time.Hour, now: time.Hour + time.Minute, want: 15 * time.Second},
		{name: "own settle, no margin", deadline: 30 * time.Second, opts: []idempotency.LockOption{
			idempotency.WithSettleTimeout(time.Second), idempotency.WithLeaseFromDeadline(0)}, want: 31 * time.Second},
		{name: "far deadline saturates", deadline: -1, want: math.MaxInt64}, // 400 years
	} {
		for _, verb := range []string{"Lock", "Mutex"} {
			t.Run(c.name+"/"+verb, func(t *testing.T) {
				s, clock, start := deadlineClock(t)
				ctx := t.Context()
				if c.deadline != 0 {
					var cancel context.CancelFunc
					dl := start.Add(c.deadline)
					if c.deadline < 0 {
						dl = start.AddDate(400, 0, 0)
					}
					ctx, cancel = context.WithDeadline(ctx, dl)
					defer cancel()
				}
				clock.Set(start.Add(c.now))
				opts := append([]idempotency.LockOption{idempotency.WithNow(clock.Now), idempotency.WithLeaseFromDeadline(5 * time.Second)}, c.opts...)
				call := idempotency.Lock
				if verb == "Mutex" {
					call = idempotency.Mutex
				}
				var expiry time.Time
				if err := call(ctx, s, "k", func(ctx context.Context) error {
					cl, _ := idempotency.ClaimFrom(ctx)
					expiry = cl.LeaseExpiry
					return nil
				}, opts...); err != nil {
					t.Fatal(err)
				}
				got := s.last(t)
				if got != c.want || store.ValidateLease(got) != nil {
					t.Fatalf("lease %v, want %v", got, c.want)
				}
				if c.want < time.Hour*24 && !expiry.Equal(clock.Now().Add(c.want)) {
					t.Fatalf("the claim's lease expiry %v, want %v", expiry, clock.Now().Add(c.want))
				}
			})
		}
	}
	if err := idempotency.Lock(t.Context(), fake.New(), "k", func(context.Context) error { return nil },
		idempotency.WithLeaseFromDeadline(-time.Second)); err == nil || !strings.Contains(err.Error(), "margin") {
		t.Fatalf("negative margin: %v, want an error", err)
	}
}

// crashingStore claims on the fake store, and then the process dies: its
// Complete and Release never reach the store.
type crashingStore struct{ *fake.Store }

func (crashingStore) Complete(context.Context, store.Claim) (bool, error) { return true, nil }
func (crashingStore) Release(context.Context, store.Claim) error          { return nil }

func (crashingStore) CompleteFingerprint(context.Context, store.Claim, string) (bool, error) {
	return true, nil
}

// A holder that crashed with a lease sized from its 30s deadline frees its
// key 30s + settle + margin after it claimed, not after store.DefaultLease.
func TestLeaseFromDeadlineFreesACrashedHoldersKeySoonAfterTheTimeout(t *testing.T) {
	for _, fromDeadline := range []bool{true, false} {
		t.Run(fmt.Sprint("from deadline ", fromDeadline), func(t *testing.T) {
			s, clock, start := deadlineClock(t)
			opts := []idempotency.Option{idempotency.WithNow(clock.Now), idempotency.WithLogger(newDiscard())}
			want := store.DefaultLease
			if fromDeadline {
				opts = append(opts, idempotency.WithLeaseFromDeadline(5*time.Second))
				want = 45 * time.Second
			}
			deliver := func(b store.Backend, runs *int) error {
				ctx, cancel := context.WithDeadline(t.Context(), clock.Now().Add(30*time.Second))
				defer cancel()
				return idempotency.Idempotent(b, opts...)(func(context.Context, cloudevents.Event) error {
					*runs++
					return nil
				})(ctx, pubsubEvent(t, "m-1", map[string]any{"messageId": "m-1"}))
			}
			var crashed, runs int
			if err := deliver(crashingStore{s.Store}, &crashed); err != nil || crashed != 1 {
				t.Fatalf("the holder: %v, runs %d", err, crashed)
			}
			clock.Set(start.Add(want - time.Nanosecond))
			var ip *idempotency.InProgressError
			if err := deliver(s, &runs); !errors.As(err, &ip) || !ip.Until.Equal(start.Add(want)) || runs != 0 {
				t.Fatalf("redelivery within the lease: %v, runs %d; want in progress until %v", err, runs, start.Add(want))
			}
			clock.Set(start.Add(want))
			if err := deliver(s, &runs); err != nil || runs != 1 {
				t.Fatalf("redelivery once the lease lapsed: %v, runs %d; want it to run", err, runs)
			}
			if rec, _ := s.Record("m-1"); rec.State != store.Done || rec.Fence != 2 {
				t.Fatalf("record %+v, want done at fence 2", rec)
			}
		})
	}
}

// A body that ignores its context and outlives a lease sized from the
// deadline: without a heartbeat a redelivery takes the key and runs the
// work again (the late Complete is fenced out, logged, acked); with one,
// renewals by this delivery's lease, at a third of it, keep the key.
func TestLeaseFromDeadlineBodyThatOutlivesItsLease(t *testing.T) {
	t.Run("no heartbeat: a redelivery runs it again", func(t *testing.T) {
		s, clock, start := deadlineClock(t)
		l, logger := newLogs()
		ctx, cancel := context.WithDeadline(t.Context(), start.Add(30*time.Second))
		defer cancel()
		opts := []idempotency.LockOption{idempotency.WithNow(clock.Now), idempotency.WithLeaseFromDeadline(5 * time.Second), idempotency.WithLogger(logger)}
		sends := 0
		err := idempotency.Lock(ctx, s, "k", func(context.Context) error {
			sends++
			clock.Set(start.Add(45 * time.Second)) // ignored the deadline, past the lease
			if err := idempotency.Lock(t.Context(), s, "k", func(context.Context) error { sends++; return nil }, opts...); err != nil {
				t.Errorf("redelivery: %v", err)
			}
			return nil
		}, opts...)
		if err != nil || sends != 2 || len(l.find(t, "ERROR", "fenced out")) != 1 {
			t.Fatalf("err %v, sends %d, logs %v; want an ack, two sends and one fenced-out error", err, sends, l.records(t))
		}
	})
	t.Run("heartbeat: the key stays held", func(t *testing.T) {
		s, clock, start := deadlineClock(t)
		ctx, cancel := context.WithDeadline(t.Context(), start.Add(time.Hour))
		defer cancel()
		// The injected clock is past the deadline: the lease is settle +
		// margin = MinSettleTimeout (100ms), and the configured 1m
		// heartbeat ticks at a third of it.
		lease := idempotency.MinSettleTimeout
		clock.Set(start.Add(time.Hour + time.Minute))
		err := idempotency.Lock(ctx, s.Store, "k", func(ctx context.Context) error {
			for range 12 { // 8 leases of work
				clock.Advance(lease * 2 / 3)
				waitExtends(t, s.Store, 1)
			}
			if rec, _ := s.Record("k"); rec.LeaseExpiry.After(clock.Now().Add(lease)) {
				t.Errorf("renewed to %v, past this delivery's lease from %v", rec.LeaseExpiry, clock.Now())
			}
			if err := idempotency.Lock(t.Context(), s, "k", func(context.Context) error {
				t.Error("a redelivery took the key from live work")
				return nil
			}); !errors.Is(err, idempotency.ErrInProgress) {
				t.Errorf("redelivery during the work: %v, want ErrInProgress", err)
			}
			return nil
		}, idempotency.WithNow(clock.Now), idempotency.WithLeaseFromDeadline(0), idempotency.WithSettleTimeout(lease),
			idempotency.WithLease(3*time.Minute), idempotency.WithHeartbeat(time.Minute))
		if err != nil {
			t.Fatal(err)
		}
		if rec, _ := s.Record("k"); rec.State != store.Done || rec.Fence != 1 {
			t.Fatalf("record %+v, want done with fence 1", rec)
		}
	})
}
