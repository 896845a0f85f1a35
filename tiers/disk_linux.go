package tiers

import (
	"os"
	"path/filepath"
	"syscall"
)

const oDirect = syscall.O_DIRECT

// preallocate reserves the file's blocks (best effort: a file system
// without fallocate gets a sparse file from Truncate).
func preallocate(f *os.File, size int64) {
	_ = syscall.Fallocate(int(f.Fd()), 0, 0, size)
}

// openIn opens name relative to the open directory dir (openat): the
// directory checked is the one the file is in, whatever its path names
// by then.
func openIn(dir *os.File, name string, flag int, perm uint32) (*os.File, error) {
	path := filepath.Join(dir.Name(), name)
	fd, err := syscall.Openat(int(dir.Fd()), name, flag|syscall.O_CLOEXEC, perm)
	if err != nil {
		return nil, &os.PathError{Op: "openat", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), path), nil
}
