//go:build linux

package tcp

import (
	"net"
	"syscall"
)

// alive reports whether an idle data connection can still carry a
// handoff: a non-blocking peek (MSG_PEEK|MSG_DONTWAIT) finds nothing to
// read. The receiver never writes on a data connection, so anything it
// finds (the peer's FIN, a reset, bytes) means the connection is done.
// It never waits.
func alive(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return true
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	live := false
	var b [1]byte
	err = rc.Read(func(fd uintptr) bool {
		for {
			_, _, e := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
			if e == syscall.EINTR {
				continue
			}
			live = e == syscall.EAGAIN
			return true // never wait for readability
		}
	})
	return err == nil && live
}
