package admin_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/admin"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// hooked is a fake.Store that runs a hook before ForceRelease or Forget,
// between an admin call's read and its write.
type hooked struct {
	*fake.Store
	beforeWrite func()
}

func (h hooked) ForceRelease(ctx context.Context, r store.Record) (bool, error) {
	if h.beforeWrite != nil {
		h.beforeWrite()
	}
	return h.Store.ForceRelease(ctx, r)
}

func (h hooked) Forget(ctx context.Context, r store.Record) (bool, error) {
	if h.beforeWrite != nil {
		h.beforeWrite()
	}
	return h.Store.Forget(ctx, r)
}

func newStore() (*fake.Store, *fake.Clock) {
	clock := fake.NewClock(start)
	return fake.New(fake.WithClock(clock.Now), fake.WithTTL(time.Hour)), clock
}

func claim(t *testing.T, s *fake.Store, key string, lease time.Duration) store.Claim {
	t.Helper()
	res, err := s.Claim(context.Background(), key, lease)
	if err != nil || res.Outcome != store.Won {
		t.Fatalf("Claim(%q) = %v, %v; want won", key, res.Outcome, err)
	}
	return res.Claim
}

func complete(t *testing.T, s *fake.Store, key string) store.Claim {
	t.Helper()
	c := claim(t, s, key, time.Minute)
	if ok, err := s.Complete(context.Background(), c); !ok || err != nil {
		t.Fatalf("Complete(%q) = %v, %v", key, ok, err)
	}
	return c
}

func TestReleaseRefusesDoneAndMissing(t *testing.T) {
	s, _ := newStore()
	complete(t, s, "k")
	ch, err := admin.Release(context.Background(), s, "k")
	if !errors.Is(err, admin.ErrNotClaimed) {
		t.Fatalf("Release of a done key: %v; want ErrNotClaimed", err)
	}
	if ch.Before.State != store.Done || ch.After != nil {
		t.Errorf("Release of a done key reported %+v", ch)
	}
	if r, _ := s.Record("k"); r.State != store.Done || r.Fence != 1 {
		t.Errorf("the done record changed: %+v", r)
	}
	if _, err := admin.Release(context.Background(), s, "absent"); !errors.Is(err, admin.ErrNotFound) {
		t.Errorf("Release of a missing key: %v; want ErrNotFound", err)
	}
	if _, err := admin.Release(context.Background(), s, ""); !errors.Is(err, store.ErrInvalidKey) {
		t.Errorf("Release of an empty key: %v; want ErrInvalidKey", err)
	}
}

func TestReleaseLapsedLease(t *testing.T) {
	s, clock := newStore()
	old := claim(t, s, "k", time.Minute)
	clock.Advance(2 * time.Minute)
	ch, err := admin.Release(context.Background(), s, "k")
	if err != nil {
		t.Fatal(err)
	}
	if ch.After == nil || ch.After.Fence != old.Fence+1 {
		t.Fatalf("after = %+v; want fence %d", ch.After, old.Fence+1)
	}
	if err := s.Release(context.Background(), old); err != nil {
		t.Fatal(err)
	}
	if r, _ := s.Record("k"); r.Fence != old.Fence+1 {
		t.Errorf("the old holder's Release moved the fence to %d", r.Fence)
	}
}

// A claim that moved between the read and the release (the holder
// released, someone reclaimed) is not released again: ErrChanged, and the
// new holder keeps its claim.
func TestReleaseChangedSinceRead(t *testing.T) {
	s, _ := newStore()
	old := claim(t, s, "k", time.Minute)
	var next store.Claim
	h := hooked{Store: s, beforeWrite: func() {
		s.Release(context.Background(), old)
		next = claim(t, s, "k", time.Minute)
	}}
	ch, err := admin.Release(context.Background(), h, "k")
	if !errors.Is(err, admin.ErrChanged) {
		t.Fatalf("Release: %v; want ErrChanged", err)
	}
	if ch.Before.Fence != old.Fence {
		t.Errorf("Before.Fence = %d; want the fence read, %d", ch.Before.Fence, old.Fence)
	}
	if ok, err := s.Complete(context.Background(), next); !ok || err != nil {
		t.Errorf("the new holder's Complete = %v, %v; its claim was released", ok, err)
	}
}

func TestForgetRefusesClaims(t *testing.T) {
	for _, lapsed := range []bool{false, true} {
		t.Run(fmt.Sprintf("lapsed=%v", lapsed), func(t *testing.T) {
			s, clock := newStore()
			c := claim(t, s, "k", time.Minute)
			if lapsed {
				clock.Advance(time.Hour)
			}
			_, err := admin.Forget(context.Background(), s, "k")
			if !errors.Is(err, admin.ErrNotDone) {
				t.Fatalf("Forget of a claim: %v; want ErrNotDone", err)
			}
			if ok, err := s.Complete(context.Background(), c); !ok || err != nil {
				t.Errorf("the holder's Complete = %v, %v after a refused Forget", ok, err)
			}
		})
	}
	s, _ := newStore()
	if _, err := admin.Forget(context.Background(), s, "absent"); !errors.Is(err, admin.ErrNotFound) {
		t.Errorf("Forget of a missing key: %v; want ErrNotFound", err)
	}
}

// A done record forgotten and completed again between the read and the
// delete is a new record: Forget leaves it.
func TestForgetChangedSinceRead(t *testing.T) {
	s, _ := newStore()
	complete(t, s, "k")
	h := hooked{Store: s, beforeWrite: func() {
		r, _, _ := s.Inspect(context.Background(), "k")
		s.Forget(context.Background(), r)
		complete(t, s, "k")
	}}
	if _, err := admin.Forget(context.Background(), h, "k"); !errors.Is(err, admin.ErrChanged) {
		t.Fatalf("Forget: %v; want ErrChanged", err)
	}
	if r, ok := s.Record("k"); !ok || r.State != store.Done {
		t.Errorf("the new done record was deleted: %+v, %v", r, ok)
	}
}

// refusing is a Lister that fails the test when called: validation must
// happen before any I/O.
type refusing struct {
	store.Operator
	t *testing.T
}

func (r refusing) List(context.Context, store.ListQuery) (store.Page, error) {
	r.t.Error("List was called")
	return store.Page{}, nil
}

func TestForgetDoneRefusesBadFilterBeforeIO(t *testing.T) {
	s, _ := newStore()
	b := refusing{Operator: s, t: t}
	for _, tc := range []struct {
		f    admin.Filter
		want error
	}{
		{admin.Filter{}, admin.ErrNoPrefix},
		{admin.Filter{DoneFrom: start}, admin.ErrNoPrefix},
		{admin.Filter{Prefix: "a", All: true}, admin.ErrInvalidFilter},
		{admin.Filter{Prefix: "a", TTL: -time.Second}, admin.ErrInvalidFilter},
		{admin.Filter{Prefix: "a", DoneFrom: start, DoneBefore: start}, admin.ErrInvalidFilter},
		{admin.Filter{Prefix: "a\x00"}, store.ErrInvalidQuery},
	} {
		if _, err := admin.ForgetDone(context.Background(), b, tc.f, false); !errors.Is(err, tc.want) {
			t.Errorf("ForgetDone(%+v): %v; want %v", tc.f, err, tc.want)
		}
	}
}

func TestForgetDoneSelects(t *testing.T) {
	s, clock := newStore()
	ctx := context.Background()
	complete(t, s, "a:1") // done 12:00
	clock.Advance(10 * time.Minute)
	complete(t, s, "a:2")           // done 12:10
	complete(t, s, "b:1")           // other prefix
	claim(t, s, "a:3", time.Hour)   // live claim
	claim(t, s, "a:4", time.Second) // lapsed claim
	clock.Advance(10 * time.Minute)
	complete(t, s, "a:5") // done 12:20
	clock.Advance(2 * time.Hour)

	f := admin.Filter{Prefix: "a:", DoneFrom: start.Add(10 * time.Minute), DoneBefore: start.Add(20 * time.Minute)}
	rep, err := admin.ForgetDone(ctx, s, f, true)
	if err != nil {
		t.Fatal(err)
	}
	if got := keys(rep.Plan); got != "[a:2]" || !rep.DryRun || rep.Forgotten != nil {
		t.Fatalf("dry run: plan %s, report %+v; want [a:2] and nothing forgotten", got, rep)
	}
	if s.Len() != 6 {
		t.Fatalf("a dry run deleted records: %d left", s.Len())
	}

	rep, err = admin.ForgetDone(ctx, s, admin.Filter{Prefix: "a:"}, false)
	if err != nil {
		t.Fatal(err)
	}
	if got := keys(rep.Forgotten); got != "[a:1 a:2 a:5]" {
		t.Errorf("forgotten %s; want every done key under a:", got)
	}
	for _, k := range []string{"b:1", "a:3", "a:4"} {
		if _, ok := s.Record(k); !ok {
			t.Errorf("%s was deleted", k)
		}
	}

	complete(t, s, "c:1")
	rep, err = admin.ForgetDone(ctx, s, admin.Filter{All: true}, false)
	if err != nil {
		t.Fatal(err)
	}
	if got := keys(rep.Forgotten); got != "[b:1 c:1]" {
		t.Errorf("All forgot %s; want [b:1 c:1]", got)
	}
}

// A planned record that changes before its turn is skipped, not deleted.
func TestForgetDoneSkipsChanged(t *testing.T) {
	s, clock := newStore()
	complete(t, s, "a:1")
	complete(t, s, "a:2")
	clock.Advance(2 * time.Hour) // both past their ttl: reclaimable
	calls := 0
	h := hooked{Store: s, beforeWrite: func() {
		calls++
		if calls == 1 {
			claim(t, s, "a:2", time.Hour) // a:2 is redelivered and reclaimed
		}
	}}
	rep, err := admin.ForgetDone(context.Background(), h, admin.Filter{Prefix: "a:"}, false)
	if err != nil {
		t.Fatal(err)
	}
	if keys(rep.Forgotten) != "[a:1]" || keys(rep.Skipped) != "[a:2]" {
		t.Errorf("forgotten %s, skipped %s; want [a:1], [a:2]", keys(rep.Forgotten), keys(rep.Skipped))
	}
	if r, ok := s.Record("a:2"); !ok || r.State != store.Claimed {
		t.Errorf("the reclaimed a:2 = %+v, %v; want its claim kept", r, ok)
	}
}

// failing fails the second Forget.
type failing struct {
	*fake.Store
	n *int
}

func (f failing) Forget(ctx context.Context, r store.Record) (bool, error) {
	*f.n++
	if *f.n == 2 {
		return false, errors.New("connection reset")
	}
	return f.Store.Forget(ctx, r)
}

func TestForgetDoneStopsOnError(t *testing.T) {
	s, _ := newStore()
	for _, k := range []string{"a:1", "a:2", "a:3"} {
		complete(t, s, k)
	}
	rep, err := admin.ForgetDone(context.Background(), failing{s, new(int)}, admin.Filter{Prefix: "a:"}, false)
	if err == nil || keys(rep.Forgotten) != "[a:1]" || len(rep.Plan) != 3 {
		t.Errorf("ForgetDone = %+v, %v; want the error after a:1", rep, err)
	}
	if s.Len() != 2 {
		t.Errorf("%d records left; want 2", s.Len())
	}
}

func TestListPagesAndStops(t *testing.T) {
	s, _ := newStore()
	for i := range 7 {
		complete(t, s, fmt.Sprintf("k%d", i))
	}
	var got []string
	for r, err := range admin.List(context.Background(), s, store.ListQuery{Limit: 3}) {
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, r.Key)
		if len(got) == 5 {
			break
		}
	}
	if fmt.Sprint(got) != "[k0 k1 k2 k3 k4]" {
		t.Errorf("listed %v", got)
	}
	n := 0
	for _, err := range admin.List(context.Background(), s, store.ListQuery{Limit: -1}) {
		n++
		if !errors.Is(err, store.ErrInvalidQuery) {
			t.Errorf("List with limit -1: %v; want ErrInvalidQuery", err)
		}
	}
	if n != 1 {
		t.Errorf("the iterator yielded %d times on an error; want once", n)
	}
}

// repeating lists every record twice, as Redis SCAN may.
type repeating struct{ *fake.Store }

func (r repeating) List(ctx context.Context, q store.ListQuery) (store.Page, error) {
	p, err := r.Store.List(ctx, q)
	p.Records = append(p.Records, p.Records...)
	return p, err
}

func TestCountAndPlanOnceEach(t *testing.T) {
	s, _ := newStore()
	complete(t, s, "a")
	claim(t, s, "b", time.Hour)
	c, err := admin.Count(context.Background(), repeating{s}, "")
	if err != nil {
		t.Fatal(err)
	}
	if c != (admin.Counts{ClaimedLive: 1, DoneLive: 1}) {
		t.Errorf("Count = %+v", c)
	}
	plan, err := admin.Plan(context.Background(), repeating{s}, admin.Filter{All: true})
	if err != nil || keys(plan) != "[a]" {
		t.Errorf("Plan = %v, %v; want [a]", keys(plan), err)
	}
}

// backendOnly is a backend without the optional interfaces.
type backendOnly struct{ store.Backend }

func TestPurgeNotSupported(t *testing.T) {
	s, _ := newStore()
	if _, err := admin.Purge(context.Background(), backendOnly{s}, 0); !errors.Is(err, admin.ErrNotSupported) {
		t.Errorf("Purge on a backend without PurgeExpired: %v; want ErrNotSupported", err)
	}
}

func keys(rs []store.Record) string {
	var ks []string
	for _, r := range rs {
		ks = append(ks, r.Key)
	}
	return fmt.Sprint(ks)
}

// stuck answers every continued listing with an empty page and the cursor
// it was given.
type stuck struct{ *fake.Store }

func (s stuck) List(ctx context.Context, q store.ListQuery) (store.Page, error) {
	if q.Cursor == "" {
		return store.Page{Next: "c1"}, nil
	}
	return store.Page{Next: q.Cursor}, nil
}

func TestListStopsWithoutProgress(t *testing.T) {
	s, _ := newStore()
	n := 0
	for _, err := range admin.List(context.Background(), stuck{s}, store.ListQuery{}) {
		n++
		if !errors.Is(err, admin.ErrNoProgress) || n > 1 {
			t.Fatalf("yield %d: %v; want one ErrNoProgress", n, err)
		}
	}
	if _, err := admin.Count(context.Background(), stuck{s}, ""); !errors.Is(err, admin.ErrNoProgress) {
		t.Errorf("Count: %v; want ErrNoProgress", err)
	}
}
