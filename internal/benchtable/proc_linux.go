package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// prSetChildSubreaper is prctl's PR_SET_CHILD_SUBREAPER.
const prSetChildSubreaper = 36

// adoptOrphans makes this process the one that inherits any process its
// descendants leave behind (a server a stopped test binary started, whose
// own child outlives it), so that reapOrphans can end them.
func adoptOrphans() {
	syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0)
}

// reapOrphans kills and reaps every child this process still has: after a
// suite, only processes its descendants left behind.
func reapOrphans() {
	self := os.Getpid()
	for range 10 {
		stats, _ := filepath.Glob("/proc/[0-9]*/stat")
		found := false
		for _, st := range stats {
			data, err := os.ReadFile(st)
			if err != nil {
				continue
			}
			// pid (comm) state ppid ...: comm may hold spaces and parens.
			rest := string(data[strings.LastIndexByte(string(data), ')')+1:])
			f := strings.Fields(rest)
			if len(f) < 2 || f[1] != strconv.Itoa(self) {
				continue
			}
			pid, err := strconv.Atoi(filepath.Base(filepath.Dir(st)))
			if err != nil {
				continue
			}
			found = true
			syscall.Kill(pid, syscall.SIGKILL)
			var ws syscall.WaitStatus
			syscall.Wait4(pid, &ws, 0, nil)
		}
		if !found {
			return
		}
		time.Sleep(100 * time.Millisecond) // a killed one's own children are adopted next
	}
}
