package storetest_test

import (
	"context"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// minimal is a backend with the port's three methods and nothing else: no
// Extend, no PurgeExpired, no CompleteFingerprint, and no Faults (it is the
// fake behind them).
type minimal struct{ s *fake.Store }

func (m minimal) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	return m.s.Claim(ctx, key, lease)
}

func (m minimal) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return m.s.Complete(ctx, c)
}

func (m minimal) Release(ctx context.Context, c store.Claim) error { return m.s.Release(ctx, c) }

// TestSuiteOn runs the suite on the fake with everything (STORETEST_BACKEND
// =full) or on minimal (=minimal). It does nothing unless
// TestOptionalCasesSkipWithTheirReasonAndNoOthers starts it.
func TestSuiteOn(t *testing.T) {
	kind, ok := os.LookupEnv("STORETEST_BACKEND")
	if !ok {
		t.Skip("run by TestOptionalCasesSkipWithTheirReasonAndNoOthers, in a process of its own")
	}
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		clock := fake.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
		s := fake.New(fake.WithClock(clock.Now))
		h := storetest.Harness{Backend: s, TTL: store.DefaultTTL, Advance: clock.Advance, Now: clock.Now, Faults: s,
			WithTTL: func(ttl time.Duration) store.Backend { return fake.New(fake.WithClock(clock.Now), fake.WithTTL(ttl)) }}
		// The fake's clock is its server's: a jump moves what it judges by.
		h.ServerClock = func(t *testing.T) storetest.JumpHarness {
			clock := fake.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
			s := fake.New(fake.WithClock(clock.Now))
			return storetest.JumpHarness{
				Harness: storetest.Harness{Backend: s, TTL: store.DefaultTTL, Advance: clock.Advance, Now: clock.Now},
				Jump:    clock.Advance,
			}
		}
		switch kind {
		case "full":
		case "minimal":
			h.Backend, h.Faults, h.ServerClock, h.WithTTL = minimal{s}, nil, nil, nil
		default:
			t.Fatalf("STORETEST_BACKEND=%q, want full or minimal", kind)
		}
		return h
	})
}

// A backend without Extender, Purger, Fingerprinter or Faults still gets
// every case but those that need them, and each of those skips saying which
// part of the port it left unchecked; a backend with all four skips nothing.
func TestOptionalCasesSkipWithTheirReasonAndNoOthers(t *testing.T) {
	if _, ok := os.LookupEnv("STORETEST_BACKEND"); ok {
		t.Skip("inside a suite run")
	}
	optional := map[string]string{
		"extend_renews_only_the_current_claim":                               "does not implement store.Extender: Extend is not checked",
		"an_extended_record_outlives_its_new_lease_by_the_ttl":               "does not implement store.Extender: Extend is not checked",
		"purge_removes_only_expired_records":                                 "does not implement store.Purger: PurgeExpired is not checked",
		"extends_at_their_limit_never_expire_a_claim_early":                  "does not implement store.Extender: Extend is not checked",
		"ttls_at_their_limit_never_expire_a_record_early":                    "Harness.WithTTL is nil: ttls at the limit of time.Duration are not checked",
		"a_claim_whose_reply_was_lost_is_won_or_an_error_never_held_or_done": "Harness.Faults is nil: retry safety",
		"a_complete_whose_reply_was_lost_is_safe_to_retry":                   "Harness.Faults is nil: retry safety",
		"a_release_whose_reply_was_lost_is_safe_to_retry":                    "Harness.Faults is nil: retry safety",
		"calls_cut_mid_flight_win_nothing_twice_and_converge":                "Harness.Faults is nil: retry safety",

		"a_fingerprint_stored_by_complete_is_reported_while_the_key_is_done":  "does not implement store.Fingerprinter: payload fingerprints are not checked",
		"a_plain_complete_stores_no_fingerprint":                              "does not implement store.Fingerprinter: payload fingerprints are not checked",
		"a_retried_complete_with_the_same_fence_keeps_the_first_fingerprint":  "does not implement store.Fingerprinter: payload fingerprints are not checked",
		"a_stale_or_released_claim_stores_no_fingerprint":                     "does not implement store.Fingerprinter: payload fingerprints are not checked",
		"a_reclaim_after_the_ttl_leaves_no_fingerprint_behind":                "does not implement store.Fingerprinter: payload fingerprints are not checked",
		"invalid_fingerprints_are_refused_and_change_nothing":                 "does not implement store.Fingerprinter: payload fingerprints are not checked",
		"fingerprints_are_stored_verbatim_up_to_MaxFingerprintLen":            "does not implement store.Fingerprinter: payload fingerprints are not checked",
		"a_complete_with_a_fingerprint_whose_reply_was_lost_is_safe_to_retry": "does not implement store.Fingerprinter: payload fingerprints are not checked",

		"a_claim_won_after_the_server_clock_jumped_is_held_for_its_lease":                   "Harness.ServerClock is nil: leases and ttls across a jump",
		"a_key_completed_after_the_server_clock_jumped_is_done_for_its_ttl":                 "Harness.ServerClock is nil: leases and ttls across a jump",
		"a_claim_or_completion_from_before_the_server_clock_jumped_never_makes_two_holders": "Harness.ServerClock is nil: leases and ttls across a jump",
	}
	full, minimal := suiteOn(t, "full"), suiteOn(t, "minimal")
	if len(full.passed) < 30 || len(full.skipped) > 0 || len(full.failed) > 0 {
		t.Fatalf("the full fake: %d cases passed, skipped %v, failed %v", len(full.passed), keys(full.skipped), keys(full.failed))
	}
	if len(minimal.failed) > 0 {
		t.Errorf("the minimal backend failed %v", keys(minimal.failed))
	}
	for name, reason := range optional {
		if !full.passed[name] {
			t.Errorf("%s is not a case of the suite", name)
		}
		if !minimal.skipped[name] {
			t.Errorf("%s did not skip on the minimal backend", name)
		} else if out := minimal.output[name]; !strings.Contains(out, reason) {
			t.Errorf("%s skipped saying %q, want it to say %q", name, out, reason)
		}
	}
	for name := range full.passed {
		if strings.Contains(name, "/") {
			continue // a subtest of a case: its case is checked
		}
		if _, ok := optional[name]; !ok && !minimal.passed[name] {
			t.Errorf("%s does not need an optional interface, but did not pass on the minimal backend", name)
		}
	}
	t.Logf("full: %d cases passed; minimal: %d passed, %d skipped", len(full.passed), len(minimal.passed), len(minimal.skipped))
}

// suiteRun is what a verbose run of TestSuiteOn printed, per case.
type suiteRun struct {
	passed, skipped, failed map[string]bool
	output                  map[string]string
}

var (
	caseLine   = regexp.MustCompile(`^=== (?:RUN|PAUSE|CONT|NAME)\s+TestSuiteOn/(\S+)`)
	resultLine = regexp.MustCompile(`^\s*--- (PASS|SKIP|FAIL): TestSuiteOn/(\S+)`)
)

// suiteOn runs TestSuiteOn on the named backend in a process of its own and
// sorts its cases by result, with each case's output.
func suiteOn(t *testing.T, kind string) suiteRun {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestSuiteOn$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), "STORETEST_BACKEND="+kind)
	out, err := cmd.CombinedOutput()
	r := suiteRun{map[string]bool{}, map[string]bool{}, map[string]bool{}, map[string]string{}}
	cur := ""
	for _, line := range strings.Split(string(out), "\n") {
		if m := caseLine.FindStringSubmatch(line); m != nil {
			cur = m[1]
			continue
		}
		if m := resultLine.FindStringSubmatch(line); m != nil {
			map[string]map[string]bool{"PASS": r.passed, "SKIP": r.skipped, "FAIL": r.failed}[m[1]][m[2]] = true
			cur = ""
			continue
		}
		if cur != "" && strings.HasPrefix(line, "    ") {
			r.output[cur] += strings.TrimSpace(line) + "\n"
		}
	}
	if err != nil && len(r.failed) == 0 {
		t.Fatalf("the %s run failed: %v\n%s", kind, err, out)
	}
	return r
}
