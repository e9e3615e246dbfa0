package storetest_test

import (
	"context"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// mutant is a backend with one deliberate bug, to prove the suite notices.
type mutant struct {
	bug   string
	clock *fake.Clock
	mu    sync.Mutex
	recs  map[string]*rec
	n     int
}

type rec struct {
	state         store.State
	fence         int64
	lease, expiry time.Time
}

func (m *mutant) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Result{}, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return store.Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return store.Result{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.clock.Now()
	r, ok := m.recs[key]
	if ok && m.bug == "record dies with its lease" && r.state == store.Claimed && !now.Before(r.lease) {
		ok = false
	}
	switch {
	case !ok:
		r = &rec{}
		m.recs[key] = r
	case r.state == store.Done && now.Before(r.expiry):
		return store.Result{Outcome: store.AlreadyDone, Until: r.expiry}, nil
	case r.state == store.Claimed && now.Before(r.lease):
		return store.Result{Outcome: store.HeldByOther, Until: r.lease}, nil
	}
	m.n++
	r.state, r.fence, r.lease = store.Claimed, r.fence+1, now.Add(lease)
	r.expiry = r.lease.Add(time.Hour)
	return store.Result{Outcome: store.Won, Claim: store.Claim{Key: key, Fence: r.fence, Token: strings.Repeat("t", m.n), LeaseExpiry: r.lease}}, nil
}

func (m *mutant) Complete(ctx context.Context, c store.Claim) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.recs[c.Key]
	if !ok {
		return false, nil
	}
	if r.fence != c.Fence && m.bug != "complete ignores the fence" {
		return false, nil
	}
	if m.bug == "complete requires a live lease" && r.state == store.Claimed && !m.clock.Now().Before(r.lease) {
		return false, nil
	}
	r.state, r.expiry = store.Done, m.clock.Now().Add(time.Hour)
	return true, nil
}

func (m *mutant) Release(ctx context.Context, c store.Claim) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.recs[c.Key]
	if !ok || r.state != store.Claimed || r.fence != c.Fence {
		return nil
	}
	switch m.bug {
	case "release deletes the record":
		delete(m.recs, c.Key)
		return nil
	case "release keeps the fence":
	default:
		r.fence++
	}
	r.lease = m.clock.Now()
	return nil
}

// TestMutant runs the suite on the mutant that STORETEST_MUTANT names. It
// does nothing unless TestSuiteCatchesMutants starts it.
func TestMutant(t *testing.T) {
	bug := os.Getenv("STORETEST_MUTANT")
	if bug == "" {
		return
	}
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		clock := fake.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
		return storetest.Harness{
			Backend: &mutant{bug: bug, clock: clock, recs: map[string]*rec{}},
			TTL:     time.Hour,
			Advance: clock.Advance,
			Now:     clock.Now,
		}
	})
}

// Each deliberate bug must fail the cases named after the rule it breaks,
// and the correct backend must fail none.
func TestSuiteCatchesMutants(t *testing.T) {
	cases := map[string][]string{
		"":                               nil, // the mutant with no bug passes
		"release deletes the record":     {"release_makes_the_key_reclaimable_at_once_with_a_higher_fence", "mutex_cycle_reclaims_forever_without_ever_completing"},
		"release keeps the fence":        {"released_claim_can_never_complete", "mutex_cycle_reclaims_forever_without_ever_completing"},
		"complete ignores the fence":     {"zombie_cannot_complete_over_a_newer_claim", "released_claim_can_never_complete"},
		"complete requires a live lease": {"complete_commits_after_the_lease_lapsed_if_nobody_reclaimed"},
		"record dies with its lease":     {"claim_after_the_lease_lapsed_reclaims_with_fence_plus_1", "zombie_cannot_complete_over_a_newer_claim"},
	}
	failLine := regexp.MustCompile(`--- FAIL: TestMutant/(\S+)`)
	for bug, want := range cases {
		name := bug
		if name == "" {
			name = "no bug"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			env := bug
			if env == "" {
				env = "none"
			}
			cmd := exec.Command(os.Args[0], "-test.run=^TestMutant$", "-test.v")
			cmd.Env = append(os.Environ(), "STORETEST_MUTANT="+env)
			out, err := cmd.CombinedOutput()
			failed := map[string]bool{}
			for _, m := range failLine.FindAllStringSubmatch(string(out), -1) {
				failed[m[1]] = true
			}
			if bug == "" {
				if err != nil || len(failed) > 0 {
					t.Fatalf("the correct backend failed %v: %v\n%s", failed, err, out)
				}
				return
			}
			if err == nil {
				t.Fatalf("the suite passed a backend whose %s", bug)
			}
			for _, w := range want {
				if !failed[w] {
					t.Errorf("%q did not fail; failed: %v", w, failed)
				}
			}
		})
	}
}
