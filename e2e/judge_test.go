package e2e

import (
	"strings"
	"testing"
	"time"
)

// The storm's oracle on hand-made histories: the legitimate re-sends (the
// previous holder died in its window, or outran its lease and was fenced
// out) pass, and each way a second run can be illegitimate is named.
func TestJudgeTellsCrashWindowsFromDuplicates(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	// Processes 1 and 5 die at 1s, 3 at 50s; 2 and 4 live on. Process 2
	// logged that its run under fence 1 was fenced out.
	deaths := map[int64]time.Time{1: at(1), 3: at(50), 5: at(1)}
	facts := func(ack float64) stormFacts {
		return stormFacts{
			diedAt: func(n int64) (time.Time, bool) { d, ok := deaths[n]; return d, ok },
			acked: func(string) (time.Time, bool) {
				if ack < 0 {
					return time.Time{}, false
				}
				return at(ack), true
			},
			fencedOut: func(n int64, key string, fence int64) bool { return n == 2 && key == "orders:A" && fence == 1 },
		}
	}
	// A run sent at s seconds, under a 2 s lease taken just before.
	call := func(fence, process int64, s float64) supplierCall {
		return supplierCall{key: "orders:A", fence: fence, incarnation: process, at: at(s), leaseExpiry: at(s + 1.9)}
	}
	for _, c := range []struct {
		name    string
		calls   []supplierCall
		ack     float64 // when the key was first acked; -1: never
		resends int
		verdict string // "ok", "overrun", or a word of the duplicate's reason
	}{
		{"one run", []supplierCall{call(1, 1, 0.5)}, 0.6, 0, "ok"},
		{"the HTTP client repeats one run's request", []supplierCall{call(1, 4, 0.5), call(1, 4, 0.6)}, 0.7, 0, "ok"},
		{"the holder died after its send; the next holder re-sends after the lease", []supplierCall{call(1, 1, 0.5), call(2, 4, 3)}, 3.1, 1, "ok"},
		{"the previous holder is alive", []supplierCall{call(1, 4, 0.5), call(2, 5, 3)}, -1, 1, "alive"},
		{"the previous holder died only after the re-send", []supplierCall{call(1, 3, 0.5), call(2, 4, 3)}, -1, 1, "alive"},
		{"the re-send comes after an ack", []supplierCall{call(1, 1, 0.5), call(2, 4, 3)}, 0.9, 1, "acked"},
		{"the re-send holds the same fence", []supplierCall{call(1, 1, 0.5), call(1, 4, 3)}, -1, 1, "fence"},
		{"the re-send comes while the dead holder's lease is live", []supplierCall{call(1, 1, 0.5), call(2, 4, 1.5)}, -1, 1, "live"},
		{"the previous holder outran its lease and was fenced out", []supplierCall{call(1, 2, 0.5), call(2, 4, 3)}, 2.9, 1, "overrun"},
		{"a fenced-out holder's lease was still live", []supplierCall{call(1, 2, 0.5), call(2, 4, 1)}, 1.1, 1, "live"},
	} {
		v := judge([]string{"orders:A"}, c.calls, facts(c.ack))
		if v.resends != c.resends {
			t.Errorf("%s: %d re-sends, want %d", c.name, v.resends, c.resends)
		}
		switch c.verdict {
		case "ok":
			if len(v.duplicates)+len(v.overruns) != 0 {
				t.Errorf("%s: judged %v %v, want a legitimate history", c.name, v.duplicates, v.overruns)
			}
		case "overrun":
			if len(v.duplicates) != 0 || len(v.overruns) != 1 {
				t.Errorf("%s: duplicates %v, overruns %v; want one overrun", c.name, v.duplicates, v.overruns)
			}
		default:
			if len(v.duplicates) != 1 || !strings.Contains(v.duplicates[0], c.verdict) {
				t.Errorf("%s: %v; want one duplicate, for %q", c.name, v.duplicates, c.verdict)
			}
		}
	}
	v := judge([]string{"orders:A", "orders:B"}, []supplierCall{call(1, 1, 0.5), {key: "orders:Z", fence: 1, incarnation: 1}}, facts(-1))
	if len(v.lost) != 1 || v.lost[0] != "orders:B" || len(v.unknown) != 1 || v.unknown[0] != "orders:Z" {
		t.Fatalf("lost %v, unknown %v; want [orders:B] and [orders:Z]", v.lost, v.unknown)
	}
}

func TestFencedOutInReadsTheLibrarysLogLine(t *testing.T) {
	log := "2026/11/30 13:45:00 INFO sending order to the supplier order=PO-1 qty=1 fence=12\n" +
		`2026/11/30 13:45:03 ERROR idempotency: the work ran but the claim was fenced out (the work outran its lease) key=orders:PO-1 fence=12 lease=2s lease_expiry="2026-11-30 13:45:02 +0000 UTC"` + "\n"
	if !fencedOutIn(log, "orders:PO-1", 12) {
		t.Fatal("the fenced-out line was not found")
	}
	for _, c := range []struct {
		key   string
		fence int64
	}{{"orders:PO-1", 1}, {"orders:PO-12", 12}, {"orders:PO", 12}} {
		if fencedOutIn(log, c.key, c.fence) {
			t.Errorf("found a fenced-out run for %s fence %d", c.key, c.fence)
		}
	}
}

func TestStormParamsFromFlagsEnvironmentAndDefaults(t *testing.T) {
	env := map[string]string{}
	getenv := func(k string) string { return env[k] }
	p, err := loadStormParams(nil, getenv)
	if err != nil || p.Orders != 100 || p.Instances != 4 || p.CrashRate != 0.1 || p.KillEvery != 300*time.Millisecond ||
		p.Lease != 2*time.Second || p.PullKillEvery != 3*time.Second || p.PullOrders != 40 || strings.Join(p.Backends, ",") != "datastore,redis,postgres" {
		t.Fatalf("defaults: %+v, %v", p, err)
	}
	env = map[string]string{"STORM_ORDERS": "1000", "STORM_INSTANCES": "8", "STORM_BACKEND": "redis, postgres",
		"STORM_CRASH_RATE": "0.2", "STORM_KILL_EVERY": "1s", "STORM_LEASE": "3s", "STORM_PULL_KILL_EVERY": "4s", "STORM_PULL_ORDERS": "7"}
	p, err = loadStormParams(map[string]string{"storm.orders": "30", "storm.backend": "postgres"}, getenv)
	if err != nil || p.Orders != 30 || p.Instances != 8 || p.CrashRate != 0.2 || p.KillEvery != time.Second ||
		p.Lease != 3*time.Second || p.PullKillEvery != 4*time.Second || p.PullOrders != 7 || strings.Join(p.Backends, ",") != "postgres" {
		t.Fatalf("a flag over the environment over the defaults: %+v, %v", p, err)
	}
	for k, bad := range map[string]string{"STORM_ORDERS": "0", "STORM_INSTANCES": "1", "STORM_CRASH_RATE": "0",
		"STORM_KILL_EVERY": "0s", "STORM_LEASE": "soon", "STORM_BACKEND": "mysql", "STORM_PULL_KILL_EVERY": "-1s", "STORM_PULL_ORDERS": "0"} {
		env = map[string]string{k: bad}
		if _, err := loadStormParams(nil, getenv); err == nil || !strings.Contains(err.Error(), k) {
			t.Errorf("%s=%s: %v, want an error naming it", k, bad, err)
		}
	}
}
