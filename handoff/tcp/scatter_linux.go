//go:build linux

package tcp

import (
	"io"
	"net"
	"syscall"
	"unsafe"
)

// newScatter returns a scatter reader over c: readv(2) straight into the
// regions when c is a *net.TCPConn (under its stall, if any), one Read
// per call otherwise.
func newScatter(c net.Conn, maxBufs int) scatter {
	r, st := raw(c)
	if tc, ok := r.(*net.TCPConn); ok {
		if rc, err := tc.SyscallConn(); err == nil {
			s := &readvScatter{rc: rc, st: st, iov: make([]syscall.Iovec, 0, maxBufs)}
			s.fn = s.step
			return s
		}
	}
	return plainScatter{c}
}

// readvScatter fills several buffers per system call. It waits for
// readability through the runtime's poller (rc.Read), so Close and
// deadlines work as for Read; each call gives the stall's timeout anew
// (a readv returns as soon as any byte came: each is progress). The
// call's state lives in the struct and the poller's callback (fn) is
// made once, so a read allocates nothing.
type readvScatter struct {
	rc    syscall.RawConn
	st    *stall // nil: no progress timeout
	iov   []syscall.Iovec
	fn    func(fd uintptr) bool // s.step
	n     int
	errno syscall.Errno
}

func (s *readvScatter) step(fd uintptr) bool {
	for {
		r, _, e := syscall.Syscall(syscall.SYS_READV, fd, uintptr(unsafe.Pointer(&s.iov[0])), uintptr(len(s.iov)))
		switch e {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false // wait for readability
		}
		s.n, s.errno = int(r), e
		return true
	}
}

func (s *readvScatter) read(bufs [][]byte) (int, error) {
	s.iov = s.iov[:0]
	s.iov = appendIovecs(s.iov, bufs)
	if len(s.iov) == 0 {
		return 0, nil
	}
	if s.st != nil {
		s.st.readDeadline()
	}
	s.n, s.errno = 0, 0
	err := s.rc.Read(s.fn)
	n, errno := s.n, s.errno
	switch {
	case err != nil:
		if s.st != nil {
			err = s.st.wrap(err)
		}
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
// buffers merged into one iovec when c is a *net.TCPConn (under its
// stall, if any), one Write per buffer otherwise.
func newGather(c net.Conn) gather {
	r, st := raw(c)
	if tc, ok := r.(*net.TCPConn); ok {
		if rc, err := tc.SyscallConn(); err == nil {
			g := &writevGather{rc: rc, st: st}
			g.fn = g.step
			return g
		}
	}
	return plainGather{c}
}

// writevGather writes several buffers per system call. It waits for
// writability through the runtime's poller (rc.Write), so Close and
// write deadlines work as for Write. The stall's timeout is given anew
// before the first writev and whenever one sent bytes before the socket
// filled: the deadline bounds the time without progress, not the write.
// The call's state lives in the struct and the poller's callback (fn)
// is made once, so a write allocates nothing.
type writevGather struct {
	rc  syscall.RawConn
	st  *stall // nil: no progress timeout
	iov []syscall.Iovec
	fn  func(fd uintptr) bool // g.step
	// The write in progress.
	bufs       [][]byte
	n          int64
	errno      syscall.Errno
	progressed bool // bytes sent since the deadline was last given
}

func (g *writevGather) step(fd uintptr) bool {
	for {
		g.iov = appendIovecs(g.iov[:0], g.bufs)
		if len(g.iov) == 0 {
			return true
		}
		k := min(len(g.iov), maxIovecs)
		r, _, e := syscall.Syscall(syscall.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&g.iov[0])), uintptr(k))
		switch e {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			if g.progressed && g.st != nil {
				// Setting a deadline takes no lock this write holds.
				g.st.writeDeadline()
			}
			g.progressed = false
			return false // wait for writability
		case 0:
		default:
			g.errno = e
			return true
		}
		g.n += int64(r)
		g.progressed = g.progressed || r > 0
		// Skip what was written by slicing the buffers themselves:
		// no pointer arithmetic across buffers.
		for left := int(r); left > 0 || (len(g.bufs) > 0 && len(g.bufs[0]) == 0); {
			if len(g.bufs[0]) > left {
				g.bufs[0] = g.bufs[0][left:]
				break
			}
			left -= len(g.bufs[0])
			g.bufs = g.bufs[1:]
		}
	}
}

func (g *writevGather) write(bufs [][]byte) (int64, error) {
	if g.st != nil {
		g.st.writeDeadline()
	}
	g.bufs, g.n, g.errno, g.progressed = bufs, 0, 0, false
	err := g.rc.Write(g.fn)
	n, errno := g.n, g.errno
	g.bufs = nil // no reference to the regions past the call
	switch {
	case err != nil:
		if g.st != nil {
			err = g.st.wrap(err)
		}
		return n, err
	case errno != 0:
		return n, errno
	}
	return n, nil
}
