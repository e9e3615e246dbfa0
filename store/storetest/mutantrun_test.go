package storetest_test

import (
	"os"
	"os/exec"
	"regexp"
	"sort"
	"sync"
	"testing"
)

// runMutants runs the test named runner once per mutant of mutants (and
// once with no bug), each in a process of its own with env set to the
// bug, and checks that every mutant fails the cases named for it and the
// mutant with no bug fails none. A run that reports fewer than minCases
// cases fails. It returns how many mutants were killed.
func runMutants(t *testing.T, runner, env string, mutants map[string][]string, minCases int) (killed int) {
	t.Helper()
	failLine := regexp.MustCompile(`--- FAIL: ` + runner + `/(\S+)`)
	passLine := regexp.MustCompile(`--- (?:PASS|SKIP): ` + runner + `/(\S+)`)
	bugs := []string{""}
	for bug := range mutants {
		bugs = append(bugs, bug)
	}
	sort.Strings(bugs)
	outs := make([][]byte, len(bugs))
	errs := make([]error, len(bugs))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 4)
	for i, bug := range bugs {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			cmd := exec.Command(os.Args[0], "-test.run=^"+runner+"$", "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), env+"="+bug)
			outs[i], errs[i] = cmd.CombinedOutput()
		})
	}
	wg.Wait()
	for i, bug := range bugs {
		name := bug
		if name == "" {
			name = "no bug"
		}
		t.Run(name, func(t *testing.T) {
			out := string(outs[i])
			failed := map[string]bool{}
			for _, m := range failLine.FindAllStringSubmatch(out, -1) {
				failed[m[1]] = true
			}
			if ran := len(passLine.FindAllString(out, -1)) + len(failed); ran < minCases {
				t.Fatalf("%s ran only %d cases: %v\n%s", runner, ran, errs[i], out)
			}
			if bug == "" {
				if errs[i] != nil || len(failed) > 0 {
					t.Fatalf("the correct implementation failed %v: %v\n%s", keys(failed), errs[i], out)
				}
				return
			}
			if errs[i] == nil {
				t.Fatalf("the suite passed a mutant whose bug is: %s", bug)
			}
			ok := true
			for _, w := range mutants[bug] {
				if !failed[w] {
					ok = false
					t.Errorf("%s did not fail; failed: %v", w, keys(failed))
				}
			}
			if ok {
				killed++
			}
		})
	}
	return killed
}
