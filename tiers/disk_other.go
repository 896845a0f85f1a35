//go:build !linux

package tiers

import (
	"os"
	"path/filepath"
)

const oDirect = 0

func preallocate(*os.File, int64) {}

// openIn opens name in dir by path: without openat here, a path swapped
// after the directory's check is not caught.
func openIn(dir *os.File, name string, flag int, perm uint32) (*os.File, error) {
	return os.OpenFile(filepath.Join(dir.Name(), name), flag, os.FileMode(perm))
}
