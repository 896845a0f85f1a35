package tiers

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"github.com/kvlease/kvlease"
)

// dirChecked runs after privateDir checked the directory (tests swap the
// path under it there).
var dirChecked = func(string) {}

// privateDir creates dir 0700 if needed, opens it and checks that it is
// a directory of the process's user that neither group nor others can
// write: slot files hold KV and prompt tokens, and whoever can write the
// directory can replace them. The checks are on the open directory, and
// the slot files are opened relative to it (openIn), so a path swapped
// after the check (a parent directory someone else can write) does not
// redirect them.
func privateDir(dir string) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("tiers: disk tier: %w", err)
	}
	f, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("tiers: disk tier: %w", err)
	}
	if err := checkDir(f); err != nil {
		_ = f.Close()
		return nil, err
	}
	// Ours and not writable by others, but perhaps listable (an existing
	// 0755): made private on the open directory, as a slot file is.
	if fi, err := f.Stat(); err == nil && fi.Mode().Perm() != 0o700 {
		if err := f.Chmod(0o700); err != nil {
			_ = f.Close()
			return nil, fmt.Errorf("tiers: disk tier directory %s: %w", dir, err)
		}
	}
	dirChecked(dir)
	return f, nil
}

func checkDir(f *os.File) error {
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("tiers: disk tier: %w", err)
	}
	dir := f.Name()
	if !fi.IsDir() {
		return fmt.Errorf("tiers: disk tier %s is not a directory: %w", dir, kvlease.ErrInvalidArgument)
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("tiers: disk tier directory %s is writable by group or others (%v): %w", dir, fi.Mode().Perm(), kvlease.ErrInvalidArgument)
	}
	if err := ownedByUs(fi); err != nil {
		return fmt.Errorf("tiers: disk tier directory %s: %w", dir, err)
	}
	return nil
}

// openSlotFile opens (or creates, 0600) the slot file name in dir, of
// size bytes, without following a symbolic link; a file of another user is refused, one
// readable by others is made private, one of another size is emptied
// first. With direct it tries O_DIRECT and falls back to buffered I/O
// when the open or an aligned read is refused; directOK says which it
// got.
func openSlotFile(dir *os.File, name string, size int64, direct bool, slotBytes int) (f *os.File, directOK bool, err error) {
	open := func(extra int) (*os.File, error) {
		f, err := openIn(dir, name, os.O_RDWR|os.O_CREATE|oNoFollow|extra, 0o600)
		if errors.Is(err, syscall.ELOOP) {
			return nil, fmt.Errorf("%s is a symbolic link (not followed): %w", filepath.Join(dir.Name(), name), kvlease.ErrInvalidArgument)
		}
		if err != nil {
			return nil, err
		}
		if err := private(f); err != nil {
			_ = f.Close()
			return nil, err
		}
		return f, nil
	}
	if direct && oDirect != 0 {
		f, err = open(oDirect)
		if err == nil {
			if err = prepare(f, size); err == nil {
				// Some file systems accept the flag and refuse the I/O.
				if _, err = f.ReadAt(alignedBuf(slotBytes), 0); err == nil {
					return f, true, nil
				}
			}
			_ = f.Close()
		}
		if !errors.Is(err, syscall.EINVAL) {
			return nil, false, err
		}
	}
	f, err = open(0)
	if err != nil {
		return nil, false, err
	}
	if err := prepare(f, size); err != nil {
		_ = f.Close()
		return nil, false, err
	}
	return f, false, nil
}

// private checks that the open file f is a regular file of ours with no
// other name (hard link) and makes it 0600.
func private(f *os.File) error {
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file: %w", f.Name(), kvlease.ErrInvalidArgument)
	}
	if err := ownedByUs(fi); err != nil {
		return fmt.Errorf("%s: %w", f.Name(), err)
	}
	if err := singleLink(fi); err != nil {
		return fmt.Errorf("%s: %w", f.Name(), err)
	}
	if fi.Mode().Perm() != 0o600 {
		return f.Chmod(0o600)
	}
	return nil
}

// prepare sizes f, emptying a file of another size first (a slot layout
// that no longer applies), preallocating its blocks where the system can.
func prepare(f *os.File, size int64) error {
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if fi.Size() == size {
		return nil
	}
	if err := f.Truncate(0); err != nil {
		return err
	}
	preallocate(f, size)
	return f.Truncate(size)
}
