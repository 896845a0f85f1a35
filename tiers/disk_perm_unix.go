//go:build unix

package tiers

import (
	"fmt"
	"os"
	"syscall"

	"github.com/kvlease/kvlease"
)

const oNoFollow = syscall.O_NOFOLLOW

// currentUID is the user slot files and their directory must belong to
// (a variable so that tests can play another user).
var currentUID = os.Getuid

// ownedByUs refuses a file or directory of another user.
func ownedByUs(fi os.FileInfo) error {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	if uid := currentUID(); int(st.Uid) != uid {
		return fmt.Errorf("owned by uid %d, not this process's user %d: %w", st.Uid, uid, kvlease.ErrInvalidArgument)
	}
	return nil
}

// singleLink refuses a file with other names (hard links): sizing or
// writing a slot file must not change a file that is also something
// else.
func singleLink(fi os.FileInfo) error {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Nlink != 1 {
		return fmt.Errorf("has %d hard links, not 1: %w", st.Nlink, kvlease.ErrInvalidArgument)
	}
	return nil
}
