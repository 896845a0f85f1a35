package handoff

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/kvlease/kvlease/handoff/internal/wire"
)

// The explorer's control connection: an in-memory link between the two
// halves on which every message waits for the explorer. A half's Write
// (one frame: ctrl.send writes each whole) queues the frame in its
// direction; the explorer delivers, drops or duplicates it, and a Read
// blocks (durably, for synctest) until a frame is delivered or the link
// is closed. During the handshake (auto) writes are delivered at once.

const (
	dirSD = 0 // source to destination
	dirDS = 1 // destination to source
)

var dirNames = [2]string{"s>d", "d>s"}

// xmsg is a frame waiting in the link.
type xmsg struct {
	frame []byte
	m     wire.Message // parsed, for names and the abstract state
	lbl   string       // label()
	step  int          // the explorer's step that wrote it
	g     uint64       // the goroutine that wrote it
}

// label names the message: its type and handoff, and the fields that
// change what it does (not its texts).
func (x *xmsg) label() string {
	if x.m == nil {
		return fmt.Sprintf("frame(%d bytes)", len(x.frame))
	}
	s := fmt.Sprintf("%v %d", x.m.Type(), x.m.Handoff())
	switch m := x.m.(type) {
	case *wire.AcceptMsg:
		s += fmt.Sprintf(" from %d", m.From)
	case *wire.RejectMsg:
		s += fmt.Sprintf(" code %d", m.Code)
	case *wire.DoneMsg:
		if m.Err != "" {
			s += " err"
		}
	case *wire.AckMsg:
		s += fmt.Sprintf(" of %v", m.Of)
	}
	return s
}

type xlink struct {
	mu     sync.Mutex
	auto   bool       // handshake: a write is readable at once
	queue  [2][]*xmsg // written, not delivered, per direction
	in     [2]chan []byte
	closed chan struct{}
	once   sync.Once
	step   int // the explorer's current step (set by it between steps)
	// writers tells the frames' writers apart (goid, a stack walk: a
	// fifth of the explorer's time). Without it, every frame written in
	// one step is ordered by its bytes, which is the same order as long
	// as no goroutine writes two frames in one step: TestExploreWriters
	// checks that this holds.
	writers bool
}

func newXLink() *xlink {
	return &xlink{auto: true, in: [2]chan []byte{make(chan []byte, 8), make(chan []byte, 8)}, closed: make(chan struct{})}
}

// ends returns the source's end and the destination's.
func (l *xlink) ends() (src, dst *xconn) {
	return &xconn{l: l, side: dirSD}, &xconn{l: l, side: dirDS}
}

func (l *xlink) isClosed() bool {
	select {
	case <-l.closed:
		return true
	default:
		return false
	}
}

// close ends the link both ways: blocked reads return io.EOF, what was
// not delivered is lost.
func (l *xlink) close() {
	l.once.Do(func() {
		l.mu.Lock()
		l.queue = [2][]*xmsg{}
		l.mu.Unlock()
		close(l.closed)
	})
}

// deliver hands message k of direction dir to its reader; keep leaves it
// queued (a duplicate).
func (l *xlink) deliver(dir, k int, keep bool) {
	l.mu.Lock()
	m := l.queue[dir][k]
	if !keep {
		l.queue[dir] = slices.Delete(l.queue[dir], k, k+1)
	}
	l.mu.Unlock()
	l.in[dir] <- bytes.Clone(m.frame)
}

func (l *xlink) drop(dir, k int) {
	l.mu.Lock()
	l.queue[dir] = slices.Delete(l.queue[dir], k, k+1)
	l.mu.Unlock()
}

// settle puts the frames written during step in a canonical order: the
// frames of one goroutine keep their order (a connection's), the
// goroutines' groups are ordered by their first frame's bytes. It
// reports whether more than one goroutine wrote in a direction (their
// order was a race of the halves, canonicalised here), and, when the
// writers are told apart, an error if one goroutine wrote two frames
// (which the order by bytes alone would not keep).
func (l *xlink) settle(step int) (raced bool, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for dir := range l.queue {
		q := l.queue[dir]
		first := len(q)
		for first > 0 && q[first-1].step == step {
			first--
		}
		fresh := q[first:]
		if len(fresh) < 2 {
			continue
		}
		if !l.writers {
			// One frame per writer: by bytes.
			raced = true
			slices.SortStableFunc(fresh, func(a, b *xmsg) int { return bytes.Compare(a.frame, b.frame) })
			continue
		}
		var order []uint64
		for _, m := range fresh {
			if !slices.Contains(order, m.g) {
				order = append(order, m.g)
			} else {
				err = fmt.Errorf("one goroutine wrote two frames in one step (%s, then %s): their order is the connection's", fresh[0].lbl, m.lbl)
			}
		}
		if len(order) < 2 {
			continue
		}
		raced = true
		groups := make(map[uint64][]*xmsg, len(order))
		for _, m := range fresh {
			groups[m.g] = append(groups[m.g], m)
		}
		slices.SortStableFunc(order, func(a, b uint64) int {
			return bytes.Compare(groups[a][0].frame, groups[b][0].frame)
		})
		out := q[:first:first]
		for _, g := range order {
			out = append(out, groups[g]...)
		}
		l.queue[dir] = out
	}
	return raced, err
}

// pending returns a copy of what waits in direction dir.
func (l *xlink) pending(dir int) []*xmsg {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.queue[dir])
}

// xconn is one end of an xlink: side dirSD is the source's (it writes
// s>d and reads d>s).
type xconn struct {
	l    *xlink
	side int
	rbuf []byte // read by the one reader of this end
}

func (c *xconn) Read(p []byte) (int, error) {
	from := 1 - c.side
	for len(c.rbuf) == 0 {
		if c.l.isClosed() {
			return 0, io.EOF
		}
		select {
		case b := <-c.l.in[from]:
			c.rbuf = b
		case <-c.l.closed:
			return 0, io.EOF
		}
	}
	n := copy(p, c.rbuf)
	c.rbuf = c.rbuf[n:]
	return n, nil
}

func (c *xconn) Write(p []byte) (int, error) {
	if c.l.isClosed() {
		return 0, net.ErrClosed
	}
	c.l.mu.Lock()
	defer c.l.mu.Unlock()
	if c.l.auto {
		c.l.in[c.side] <- bytes.Clone(p)
		return len(p), nil
	}
	m := &xmsg{frame: bytes.Clone(p), step: c.l.step}
	if c.l.writers {
		m.g = goid()
	}
	if msg, _, err := wire.ReadFrame(bytes.NewReader(m.frame), nil); err == nil {
		m.m = msg
	}
	m.lbl = m.label()
	c.l.queue[c.side] = append(c.l.queue[c.side], m)
	return len(p), nil
}

func (c *xconn) Close() error                     { c.l.close(); return nil }
func (c *xconn) LocalAddr() net.Addr              { return xaddr(c.side) }
func (c *xconn) RemoteAddr() net.Addr             { return xaddr(1 - c.side) }
func (c *xconn) SetDeadline(time.Time) error      { return nil }
func (c *xconn) SetReadDeadline(time.Time) error  { return nil }
func (c *xconn) SetWriteDeadline(time.Time) error { return nil }

type xaddr int

func (a xaddr) Network() string { return "explore" }
func (a xaddr) String() string  { return [2]string{"source", "destination"}[a] }

// goid returns the calling goroutine's id (from its stack header), which
// tells the frames of one writer from another's.
func goid() uint64 {
	var buf [64]byte
	b := buf[:runtime.Stack(buf[:], false)]
	b = bytes.TrimPrefix(b, []byte("goroutine "))
	if i := bytes.IndexByte(b, ' '); i > 0 {
		b = b[:i]
	}
	id, _ := strconv.ParseUint(string(b), 10, 64)
	return id
}
