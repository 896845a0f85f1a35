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
	s.iov = appendIovecs(s.iov, bufs)
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

// appendIovecs appends an iovec per buffer of bufs to iov, one for each
// run of buffers adjacent in memory (a run of blocks is one descriptor),
// skipping empty ones. Only addresses are compared: the merged iovec
// goes to the kernel, no Go slice spans two buffers.
func appendIovecs(iov []syscall.Iovec, bufs [][]byte) []syscall.Iovec {
	var last []byte
	for _, b := range bufs {
		if len(b) == 0 {
			continue
		}
		if n := len(iov); n > 0 && adjacent(last, b) {
			iov[n-1].SetLen(int(iov[n-1].Len) + len(b))
		} else {
			v := syscall.Iovec{Base: &b[0]}
			v.SetLen(len(b))
			iov = append(iov, v)
		}
		last = b
	}
	return iov
}

// maxIovecs is the most iovecs one writev takes (IOV_MAX).
const maxIovecs = 1024

// newGather returns a gathered writer over c: writev(2) with adjacent
// buffers merged into one iovec when c is a *net.TCPConn, net.Buffers
// otherwise.
func newGather(c net.Conn) gather {
	if tc, ok := c.(*net.TCPConn); ok {
		if rc, err := tc.SyscallConn(); err == nil {
			return &writevGather{rc: rc}
		}
	}
	return plainGather{c}
}

// writevGather writes several buffers per system call. It waits for
// writability through the runtime's poller (rc.Write), so Close and
// write deadlines work as for Write.
type writevGather struct {
	rc  syscall.RawConn
	iov []syscall.Iovec
}

func (g *writevGather) write(bufs [][]byte) (int64, error) {
	var n int64
	var errno syscall.Errno
	err := g.rc.Write(func(fd uintptr) bool {
		for {
			g.iov = appendIovecs(g.iov[:0], bufs)
			if len(g.iov) == 0 {
				return true
			}
			k := min(len(g.iov), maxIovecs)
			r, _, e := syscall.Syscall(syscall.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&g.iov[0])), uintptr(k))
			switch e {
			case syscall.EINTR:
				continue
			case syscall.EAGAIN:
				return false // wait for writability
			case 0:
			default:
				errno = e
				return true
			}
			n += int64(r)
			// Skip what was written by slicing the buffers themselves:
			// no pointer arithmetic across buffers.
			for left := int(r); left > 0 || (len(bufs) > 0 && len(bufs[0]) == 0); {
				if len(bufs[0]) > left {
					bufs[0] = bufs[0][left:]
					break
				}
				left -= len(bufs[0])
				bufs = bufs[1:]
			}
		}
	})
	switch {
	case err != nil:
		return n, err
	case errno != 0:
		return n, errno
	}
	return n, nil
}
