package tiers

import (
	"os"
	"syscall"
)

const oDirect = syscall.O_DIRECT

// preallocate reserves the file's blocks (best effort: a file system
// without fallocate gets a sparse file from Truncate).
func preallocate(f *os.File, size int64) {
	_ = syscall.Fallocate(int(f.Fd()), 0, 0, size)
}
