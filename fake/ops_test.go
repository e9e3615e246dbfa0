package fake_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

func TestOpsOpNames(t *testing.T) {
	for op, want := range map[fake.Op]string{
		fake.OpInspect: "Inspect", fake.OpList: "List", fake.OpForceRelease: "ForceRelease", fake.OpForget: "Forget",
	} {
		if got := op.String(); got != want {
			t.Errorf("Op(%d).String() = %q, want %q", int(op), got, want)
		}
	}
}

// FailNext fails an operation without effect; LoseNextReply keeps its
// effect and loses the answer; Calls counts every call.
func TestOpsFaults(t *testing.T) {
	ctx := context.Background()
	clock := fake.NewClock(epoch)
	s := fake.New(fake.WithClock(clock.Now))
	live, _ := s.Claim(ctx, "live", time.Minute)
	done, _ := s.Claim(ctx, "done", time.Minute)
	s.Complete(ctx, done.Claim)
	lr, _, _ := s.Inspect(ctx, "live")
	dr, _, _ := s.Inspect(ctx, "done")
	boom := errors.New("boom")

	s.FailNext(fake.OpInspect, boom)
	if _, _, err := s.Inspect(ctx, "live"); !errors.Is(err, boom) {
		t.Fatalf("Inspect after FailNext: %v, want boom", err)
	}
	s.FailNext(fake.OpList, boom)
	if _, err := s.List(ctx, store.ListQuery{}); !errors.Is(err, boom) {
		t.Fatalf("List after FailNext: %v, want boom", err)
	}
	s.FailNext(fake.OpForceRelease, boom)
	if ok, err := s.ForceRelease(ctx, lr); ok || !errors.Is(err, boom) {
		t.Fatalf("ForceRelease after FailNext = %v, %v; want boom", ok, err)
	}
	s.FailNext(fake.OpForget, boom)
	if ok, err := s.Forget(ctx, dr); ok || !errors.Is(err, boom) {
		t.Fatalf("Forget after FailNext = %v, %v; want boom", ok, err)
	}
	if r, _ := s.Record("live"); r.Fence != live.Claim.Fence {
		t.Fatalf("a failed ForceRelease changed the fence to %d", r.Fence)
	}
	if _, ok := s.Record("done"); !ok {
		t.Fatal("a failed Forget deleted the record")
	}

	s.LoseNextReply()
	if ok, err := s.ForceRelease(ctx, lr); ok || !errors.Is(err, fake.ErrReplyLost) {
		t.Fatalf("ForceRelease with its reply lost = %v, %v; want ErrReplyLost", ok, err)
	}
	if r, _ := s.Record("live"); r.Fence != live.Claim.Fence+1 || !r.LeaseExpiry.Equal(epoch) {
		t.Fatalf("ForceRelease whose reply was lost: record %+v, want it released", r)
	}
	s.LoseNextReply()
	if ok, err := s.Forget(ctx, dr); ok || !errors.Is(err, fake.ErrReplyLost) {
		t.Fatalf("Forget with its reply lost = %v, %v; want ErrReplyLost", ok, err)
	}
	if _, ok := s.Record("done"); ok {
		t.Fatal("Forget whose reply was lost kept the record")
	}
	for op, want := range map[fake.Op]int{fake.OpInspect: 3, fake.OpList: 1, fake.OpForceRelease: 2, fake.OpForget: 2} {
		if got := s.Calls(op); got != want {
			t.Errorf("Calls(%v) = %d, want %d", op, got, want)
		}
	}
}

// List reads in byte-wise key order, so that its pages are the same on
// every run, and its cursor belongs to one prefix and state.
func TestOpsListOrderAndCursor(t *testing.T) {
	ctx := context.Background()
	s := fake.New(fake.WithClock(fake.NewClock(epoch).Now))
	for _, k := range []string{"k/b", "k/\xff", "k/a", "k/B", "k/ab", "l/a"} {
		s.Claim(ctx, k, time.Minute)
	}
	var got []string
	q := store.ListQuery{Prefix: "k/", Limit: 2}
	for pages := 0; ; pages++ {
		p, err := s.List(ctx, q)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range p.Records {
			got = append(got, r.Key)
		}
		if p.Next == "" {
			break
		}
		if pages > 0 && len(p.Records) != 2 {
			t.Fatalf("page %d holds %d records, want 2 before the last", pages+1, len(p.Records))
		}
		if _, err := s.List(ctx, store.ListQuery{Prefix: "k/", State: store.Done, Cursor: p.Next}); !errors.Is(err, store.ErrInvalidQuery) {
			t.Fatalf("a cursor used for another state: %v, want ErrInvalidQuery", err)
		}
		q.Cursor = p.Next
	}
	if want := []string{"k/B", "k/a", "k/ab", "k/b", "k/\xff"}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("List order %q, want %q", got, want)
	}
	// A listing that ends on a full page reports no Next.
	if p, err := s.List(ctx, store.ListQuery{Prefix: "l/", Limit: 1}); err != nil || len(p.Records) != 1 || p.Next != "" {
		t.Fatalf("List of exactly one page = %d records, Next %q, %v; want 1 record and no Next", len(p.Records), p.Next, err)
	}
	for _, c := range []string{"garbage", "fake1.!!", "fake1." + "a2V5"} {
		if _, err := s.List(ctx, store.ListQuery{Prefix: "k/", Cursor: c}); !errors.Is(err, store.ErrInvalidQuery) {
			t.Errorf("List(cursor %q): %v, want ErrInvalidQuery", c, err)
		}
	}
}
