//go:build !unix

package bench

// processCPU cannot read the process's CPU time here.
func processCPU() (int64, bool) { return 0, false }
