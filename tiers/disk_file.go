package tiers

import (
	"errors"
	"os"
	"syscall"
)

// openSlotFile opens (or creates) a slot file of size bytes; a file of
// another size is emptied first. With direct it tries O_DIRECT and falls
// back to buffered I/O when the open or an aligned read is refused;
// directOK says which it got.
func openSlotFile(path string, size int64, direct bool, slotBytes int) (f *os.File, directOK bool, err error) {
	if fi, err := os.Stat(path); err == nil && fi.Size() != size {
		if err := os.Truncate(path, 0); err != nil {
			return nil, false, err
		}
	}
	if direct && oDirect != 0 {
		f, err = os.OpenFile(path, os.O_RDWR|os.O_CREATE|oDirect, 0o644)
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
	f, err = os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, false, err
	}
	if err := prepare(f, size); err != nil {
		_ = f.Close()
		return nil, false, err
	}
	return f, false, nil
}

// prepare sizes f, preallocating its blocks where the system can.
func prepare(f *os.File, size int64) error {
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if fi.Size() == size {
		return nil
	}
	preallocate(f, size)
	return f.Truncate(size)
}
