package handoff

import (
	"net"
	"sync"
	"time"
)

// DefaultFrameTimeout bounds how long a frame that has begun may take to
// arrive whole, and how long a write may block.
const DefaultFrameTimeout = 10 * time.Second

// ctrl is one control connection: framed reads on one goroutine, writes
// serialised by a mutex, each with a deadline. In a psk session every
// frame travels in a sealed record (ch).
type ctrl struct {
	c       net.Conn
	ch      *channel // nil unless psk
	timeout time.Duration
	rbuf    []byte

	wmu  sync.Mutex
	wbuf []byte // the frame, or in a psk session its record
}

func newCtrl(c net.Conn, timeout time.Duration) *ctrl {
	if timeout <= 0 {
		timeout = DefaultFrameTimeout
	}
	return &ctrl{c: c, timeout: timeout}
}

// read waits (without a deadline) for a frame to begin, then gives the
// rest of it the frame timeout.
func (c *ctrl) read() (Message, error) {
	_ = c.c.SetReadDeadline(time.Time{})
	began := func() { _ = c.c.SetReadDeadline(time.Now().Add(c.timeout)) }
	if c.ch != nil {
		frame, buf, err := c.ch.readRecord(c.c, c.rbuf, began)
		c.rbuf = buf
		if err != nil {
			return nil, err
		}
		return parseFrame(frame)
	}
	m, buf, err := readFrame(c.c, c.rbuf, began)
	c.rbuf = buf
	return m, err
}

func (c *ctrl) send(m Message) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.ch == nil {
		c.wbuf = AppendFrame(c.wbuf[:0], m)
	} else {
		// The frame goes after room for the record header and is
		// sealed where it lies.
		var head [recordHeader]byte
		c.wbuf = c.ch.sealTail(AppendFrame(append(c.wbuf[:0], head[:]...), m), 0)
	}
	_ = c.c.SetWriteDeadline(time.Now().Add(c.timeout))
	_, err := c.c.Write(c.wbuf)
	return err
}
