package tiers

import (
	"syscall"
	"time"
	"unsafe"
)

// cpuTime returns the CPU time the process has used.
func cpuTime() time.Duration { return clock(2) } // CLOCK_PROCESS_CPUTIME_ID

// threadTime returns the CPU time the calling OS thread has used (lock
// the goroutine to its thread to make that the goroutine's).
func threadTime() time.Duration { return clock(3) } // CLOCK_THREAD_CPUTIME_ID

func clock(id uintptr) time.Duration {
	var ts syscall.Timespec
	if _, _, e := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, id, uintptr(unsafe.Pointer(&ts)), 0); e != 0 {
		return 0
	}
	return time.Duration(ts.Nano())
}
