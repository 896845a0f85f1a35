//go:build linux

package bench_test

import (
	"syscall"
	"time"
)

// threadCPU returns the CPU time (user + system) the calling OS thread
// has used; the caller holds its thread (runtime.LockOSThread).
func threadCPU() time.Duration {
	const rusageThread = 1 // RUSAGE_THREAD
	var ru syscall.Rusage
	if err := syscall.Getrusage(rusageThread, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
