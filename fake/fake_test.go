package fake_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
	"github.com/google/go-cmp/cmp"
)

var epoch = time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)

func TestContract(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		clock := fake.NewClock(epoch)
		s := fake.New(fake.WithClock(clock.Now))
		return storetest.Harness{
			Backend: s,
			TTL:     store.DefaultTTL,
			Advance: clock.Advance,
			Now:     clock.Now,
			Faults:  s,
			WithTTL: func(ttl time.Duration) store.Backend { return fake.New(fake.WithClock(clock.Now), fake.WithTTL(ttl)) },
		}
	})
}

// The fake implements every operation (store.Operator) by the rules.
func TestOps(t *testing.T) {
	storetest.RunOps(t, func(t *testing.T) storetest.Harness {
		clock := fake.NewClock(epoch)
		s := fake.New(fake.WithClock(clock.Now))
		return storetest.Harness{Backend: s, TTL: store.DefaultTTL, Advance: clock.Advance, Now: clock.Now, Faults: s}
	})
}

// The operations hold with the system clock and real waiting too.
func TestOpsRealTime(t *testing.T) {
	if testing.Short() {
		t.Skip("real-time operations run skipped in -short mode")
	}
	storetest.RunOps(t, func(t *testing.T) storetest.Harness {
		s := fake.New(fake.WithTTL(time.Second))
		return storetest.Harness{Backend: s, TTL: time.Second, Step: 20 * time.Millisecond, Faults: s}
	})
}

// The suite also holds with the system clock and real waiting.
func TestContractRealTime(t *testing.T) {
	if testing.Short() {
		t.Skip("real-time contract run skipped in -short mode")
	}
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		s := fake.New(fake.WithTTL(time.Second))
		return storetest.Harness{
			Backend: s,
			TTL:     time.Second,
			Step:    20 * time.Millisecond,
			Faults:  s,
			WithTTL: func(ttl time.Duration) store.Backend { return fake.New(fake.WithTTL(ttl)) },
		}
	})
}

func TestZeroValueIsUsable(t *testing.T) {
	var s fake.Store
	ctx := context.Background()
	r, err := s.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("Claim on zero Store = %v, %v", r.Outcome, err)
	}
	if s.TTL() != store.DefaultTTL {
		t.Fatalf("TTL() = %v, want %v", s.TTL(), store.DefaultTTL)
	}
	rec, ok := s.Record("k")
	if !ok || rec.ExpiresAt.Sub(rec.LeaseExpiry) != store.DefaultTTL {
		t.Fatalf("record %+v: a claimed record must outlive its lease by the ttl", rec)
	}
}

func TestRecordShowsTheStateMachine(t *testing.T) {
	clock := fake.NewClock(epoch)
	s := fake.New(fake.WithClock(clock.Now), fake.WithTTL(10*time.Minute))
	ctx := context.Background()

	r, _ := s.Claim(ctx, "po-1", time.Minute)
	rec, _ := s.Record("po-1")
	want := fake.Record{
		State:       store.Claimed,
		Fence:       1,
		Token:       r.Claim.Token,
		LeaseExpiry: epoch.Add(time.Minute),
		ExpiresAt:   epoch.Add(11 * time.Minute),
	}
	if diff := cmp.Diff(want, rec); diff != "" {
		t.Fatalf("after claim (-want +got):\n%s", diff)
	}

	clock.Advance(30 * time.Second)
	if err := s.Release(ctx, r.Claim); err != nil {
		t.Fatal(err)
	}
	rec, _ = s.Record("po-1")
	want = fake.Record{
		State:       store.Claimed,
		Fence:       2,
		Token:       r.Claim.Token,
		LeaseExpiry: epoch.Add(30 * time.Second),
		ExpiresAt:   epoch.Add(30*time.Second + 10*time.Minute),
	}
	if diff := cmp.Diff(want, rec); diff != "" {
		t.Fatalf("after release (-want +got):\n%s", diff)
	}

	r, _ = s.Claim(ctx, "po-1", time.Minute)
	clock.Advance(5 * time.Minute) // the work outran its lease; nobody reclaimed
	if ok, err := s.Complete(ctx, r.Claim); !ok || err != nil {
		t.Fatalf("Complete = %v, %v", ok, err)
	}
	rec, _ = s.Record("po-1")
	want = fake.Record{
		State:       store.Done,
		Fence:       3,
		Token:       r.Claim.Token,
		LeaseExpiry: epoch.Add(90 * time.Second),
		ExpiresAt:   epoch.Add(30*time.Second + 5*time.Minute + 10*time.Minute),
	}
	if diff := cmp.Diff(want, rec); diff != "" {
		t.Fatalf("after complete (-want +got):\n%s", diff)
	}
	if s.Len() != 1 {
		t.Fatalf("Len = %d, want 1", s.Len())
	}
}

func TestFailNextInjectsOneFaultPerCall(t *testing.T) {
	s := fake.New()
	ctx := context.Background()
	boom := errors.New("boom")
	s.FailNext(fake.OpClaim, boom)
	if _, err := s.Claim(ctx, "k", time.Minute); !errors.Is(err, boom) {
		t.Fatalf("first Claim err = %v, want boom", err)
	}
	if _, ok := s.Record("k"); ok {
		t.Fatal("a failed claim left a record")
	}
	r, err := s.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("second Claim = %v, %v", r.Outcome, err)
	}
	s.FailNext(fake.OpComplete, boom)
	if _, err := s.Complete(ctx, r.Claim); !errors.Is(err, boom) {
		t.Fatalf("Complete err = %v, want boom", err)
	}
	if rec, _ := s.Record("k"); rec.State != store.Claimed {
		t.Fatalf("a failed complete changed the state to %v", rec.State)
	}
	if got := s.Calls(fake.OpClaim); got != 2 {
		t.Fatalf("Calls(OpClaim) = %d, want 2", got)
	}
	if got := fake.OpRelease.String(); got != "Release" {
		t.Fatalf("OpRelease.String() = %q", got)
	}
}

func TestInvalidTTLPanicsWithAClearMessage(t *testing.T) {
	defer func() {
		r := recover()
		msg, _ := r.(string)
		if !strings.Contains(msg, "ttl") || !strings.Contains(msg, "-1s") {
			t.Fatalf("recover() = %v, want a message", r)
		}
	}()
	fake.New(fake.WithTTL(-time.Second))
}

func TestPurgeHonoursTheLimit(t *testing.T) {
	clock := fake.NewClock(epoch)
	s := fake.New(fake.WithClock(clock.Now), fake.WithTTL(time.Minute))
	ctx := context.Background()
	for _, k := range []string{"a", "b", "c"} {
		r, _ := s.Claim(ctx, k, time.Minute)
		s.Complete(ctx, r.Claim)
	}
	clock.Advance(2 * time.Minute)
	if n, err := s.PurgeExpired(ctx, 2); n != 2 || err != nil {
		t.Fatalf("PurgeExpired(2) = %d, %v", n, err)
	}
	if n, _ := s.PurgeExpired(ctx, 2); n != 1 {
		t.Fatalf("second PurgeExpired(2) = %d, want 1", n)
	}
}

// Extend validates its key before anything else, as the port's MUST rule
// asks of every method: a bad key is ErrInvalidKey, not ErrLost.
func TestExtendRefusesAnInvalidKey(t *testing.T) {
	s := fake.New()
	ctx := context.Background()
	for _, k := range []string{"", "nul\x00byte", strings.Repeat("x", store.MaxKeyLen+1)} {
		_, err := s.Extend(ctx, store.Claim{Key: k, Fence: 1}, time.Minute)
		if !errors.Is(err, store.ErrInvalidKey) {
			t.Errorf("Extend(%.20q...): err = %v, want ErrInvalidKey", k, err)
		}
	}
	if got := s.Calls(fake.OpExtend); got != 0 {
		t.Errorf("Calls(OpExtend) = %d: an invalid key reached the store", got)
	}
}

// A lost reply hides the answer, not the effect: the caller sees
// ErrReplyLost, and the store changed as if the reply had arrived.
func TestLoseNextReplyKeepsTheEffect(t *testing.T) {
	s := fake.New()
	ctx := context.Background()
	s.LoseNextReply()
	if _, err := s.Claim(ctx, "k", time.Minute); !errors.Is(err, fake.ErrReplyLost) {
		t.Fatalf("Claim err = %v, want ErrReplyLost", err)
	}
	rec, ok := s.Record("k")
	if !ok || rec.State != store.Claimed || rec.Fence != 1 {
		t.Fatalf("record after a claim whose reply was lost: %+v, %v; want claimed at fence 1", rec, ok)
	}
	// One reply only: the next call answers.
	r, err := s.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.HeldByOther {
		t.Fatalf("next Claim = %v, %v; want held by other (the lost claim holds the key)", r.Outcome, err)
	}
	c := store.Claim{Key: "k", Fence: rec.Fence, Token: rec.Token, LeaseExpiry: rec.LeaseExpiry}
	s.LoseNextReply()
	if _, err := s.Complete(ctx, c); !errors.Is(err, fake.ErrReplyLost) {
		t.Fatalf("Complete err = %v, want ErrReplyLost", err)
	}
	if rec, _ := s.Record("k"); rec.State != store.Done {
		t.Fatalf("state after a complete whose reply was lost: %v, want done", rec.State)
	}
	if ok, err := s.Complete(ctx, c); !ok || err != nil {
		t.Fatalf("retried Complete = %v, %v; want true", ok, err)
	}
}

// CutConnections fails the calls in flight, before or after their effect;
// calls made afterwards work.
func TestCutConnectionsFailsOnlyTheCallsInFlight(t *testing.T) {
	s := fake.New()
	ctx := context.Background()
	s.CutConnections()
	if r, err := s.Claim(ctx, "after", time.Minute); err != nil || r.Outcome != store.Won {
		t.Fatalf("Claim after the cut = %v, %v; want won", r.Outcome, err)
	}
	var wg sync.WaitGroup
	var lost atomic.Int32
	stop := make(chan struct{})
	for i := range 4 {
		wg.Go(func() {
			for j := 0; ; j++ {
				select {
				case <-stop:
					return
				default:
				}
				_, err := s.Claim(ctx, fmt.Sprint("k", i, "-", j), time.Minute)
				if errors.Is(err, fake.ErrReplyLost) {
					lost.Add(1)
				} else if err != nil {
					t.Errorf("Claim: %v", err)
				}
			}
		})
	}
	for range 200 {
		s.CutConnections()
		time.Sleep(100 * time.Microsecond)
	}
	close(stop)
	wg.Wait()
	if lost.Load() == 0 {
		t.Fatal("200 cuts under load failed no call")
	}
}
