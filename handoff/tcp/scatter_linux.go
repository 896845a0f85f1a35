//go:build linux

package tcp

import (
	"io"
	"net"
	"syscall"
	"unsafe"
)

// newScatter returns a scatter reader over c: readv(2) straight into the
// regions when c is a *net.TCPConn, one Read per call otherwise.
func newScatter(c net.Conn, maxBufs int) scatter {
	if tc, ok := c.(*net.TCPConn); ok {
		if rc, err := tc.SyscallConn(); err == nil {
			return &readvScatter{rc: rc, iov: make([]syscall.Iovec, 0, maxBufs)}
		}
	}
	return plainScatter{c}
}

// readvScatter fills several buffers per system call. It waits for
// readability through the runtime's poller (rc.Read), so Close and
// deadlines work as for Read.
type readvScatter struct {
	rc  syscall.RawConn
	iov []syscall.Iovec
}

func (s *readvScatter) read(bufs [][]byte) (int, error) {
	s.iov = s.iov[:0]
	for _, b := range bufs {
		if len(b) == 0 {
			continue
		}
		v := syscall.Iovec{Base: &b[0]}
		v.SetLen(len(b))
		s.iov = append(s.iov, v)
	}
	if len(s.iov) == 0 {
		return 0, nil
	}
	var n int
	var errno syscall.Errno
	err := s.rc.Read(func(fd uintptr) bool {
		for {
			r, _, e := syscall.Syscall(syscall.SYS_READV, fd, uintptr(unsafe.Pointer(&s.iov[0])), uintptr(len(s.iov)))
			switch e {
			case syscall.EINTR:
				continue
			case syscall.EAGAIN:
				return false // wait for readability
			}
			n, errno = int(r), e
			return true
		}
	})
	switch {
	case err != nil:
		return 0, err
	case errno != 0:
		return 0, errno
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}
