//go:build unix

package bench

import "syscall"

// processCPU returns the CPU time this process has used (user and
// system), in nanoseconds, and whether it could be read.
func processCPU() (int64, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return ru.Utime.Nano() + ru.Stime.Nano(), true
}
