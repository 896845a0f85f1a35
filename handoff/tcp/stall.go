package tcp

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"
)

// The progress timeout (Config.StallTimeout). A transfer's loop reads or
// writes its data connection through a stall: before every read or
// write that may block, the connection's deadline moves to now plus the
// timeout (unless it moved less than a sixteenth of it ago), and a
// gathered write that sends part of its bytes before the socket fills
// moves it again (writevGather), so the deadline measures the time
// without progress, not the transfer's length. A read or write that
// makes no progress for the timeout (at least 15/16 of it) fails with
// ErrStalled, and the loop returns: that return is the side's evidence
// (its own goroutine no longer touches the regions), whatever the
// handoff's Deadline, none included. A frozen peer, malicious or not, so
// holds our blocks for at most StallTimeout past its last byte.
//
// A cancel (stop) sets the deadline in the past and keeps it there: no
// refresh moves it back, so a cancel that races a refresh still ends a
// blocked read or write at once. Once the loop has returned (done) the
// stall leaves the connection alone, and a reused connection gets its
// deadlines from whoever uses it next.

// stall is one transfer's progress timeout on its data connection (the
// connection can change before the first byte: a reused one found dead
// is replaced). It is a net.Conn whose Read and Write refresh the
// deadline first.
type stall struct {
	net.Conn
	d time.Duration

	mu         sync.Mutex
	stopped    bool      // cancelled: the deadline stays in the past
	done       bool      // the loop has returned: hands off the connection
	rset, wset time.Time // when the read and write deadlines were last given
}

func newStall(d time.Duration) *stall { return &stall{d: d} }

// use makes c the stall's connection. A cancel that came before applies
// to it at once.
func (s *stall) use(c net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.Conn = c
	s.rset, s.wset = time.Time{}, time.Time{}
	if s.stopped {
		_ = c.SetDeadline(time.Now())
	}
}

// readDeadline and writeDeadline give the next read or write until now
// plus the timeout, unless the transfer was cancelled. Setting a
// deadline costs about half a microsecond (the runtime's timer), so one
// given less than a sixteenth of the timeout ago stands: a read or
// write then fails after at least 15/16 of the timeout without progress.
func (s *stall) readDeadline() {
	now := time.Now()
	s.mu.Lock()
	if !s.stopped && now.Sub(s.rset) >= s.d/16 {
		s.rset = now
		_ = s.Conn.SetReadDeadline(now.Add(s.d))
	}
	s.mu.Unlock()
}

func (s *stall) writeDeadline() {
	now := time.Now()
	s.mu.Lock()
	if !s.stopped && now.Sub(s.wset) >= s.d/16 {
		s.wset = now
		_ = s.Conn.SetWriteDeadline(now.Add(s.d))
	}
	s.mu.Unlock()
}

// stop is the cancel: the deadline in the past, for good. A no-op once
// the loop has returned, so that a late cancel does not reach a
// connection kept for the next handoff.
func (s *stall) stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return
	}
	s.stopped = true
	if s.Conn != nil {
		_ = s.Conn.SetDeadline(time.Now())
	}
}

// finish is told that the loop has returned. A connection that ended
// cleanly (not cancelled) is left with no deadline, for its next use.
func (s *stall) finish() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.done = true
	if !s.stopped && s.Conn != nil {
		_ = s.Conn.SetDeadline(time.Time{})
	}
}

// wrap says ErrStalled for a read or write that the progress timeout
// ended; a cancel's deadline (stopped) is left for the loop to name.
func (s *stall) wrap(err error) error {
	if err == nil || !errors.Is(err, os.ErrDeadlineExceeded) {
		return err
	}
	s.mu.Lock()
	stopped := s.stopped
	s.mu.Unlock()
	if stopped {
		return err
	}
	return fmt.Errorf("%w: no progress for %v (%w)", ErrStalled, s.d, err)
}

func (s *stall) Read(p []byte) (int, error) {
	s.readDeadline()
	n, err := s.Conn.Read(p)
	return n, s.wrap(err)
}

func (s *stall) Write(p []byte) (int, error) {
	s.writeDeadline()
	n, err := s.Conn.Write(p)
	return n, s.wrap(err)
}

// raw returns the connection under a stall (or c itself), for the
// scattered reads and gathered writes that reach a *net.TCPConn's file
// descriptor, with the stall to refresh (nil for none).
func raw(c net.Conn) (net.Conn, *stall) {
	if s, ok := c.(*stall); ok {
		return s.Conn, s
	}
	return c, nil
}
