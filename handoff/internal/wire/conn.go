package wire

import (
	"net"
	"sync"
	"time"
)

// DefaultFrameTimeout bounds how long a frame that has begun may take to
// arrive whole, and how long a write may block.
const DefaultFrameTimeout = 10 * time.Second

// Conn is one control connection: framed reads on one goroutine, writes
// serialised by a mutex, each with a deadline. In a psk session every
// frame travels in a sealed record (ch).
type Conn struct {
	c       net.Conn
	ch      *Channel // nil unless psk
	timeout time.Duration
	rbuf    []byte

	wmu  sync.Mutex
	wbuf []byte // the frame, or in a psk session its record
}

// NewConn returns the control connection over c: ch is the psk session's
// record layer (nil otherwise), timeout the frame timeout
// (DefaultFrameTimeout when not positive).
func NewConn(c net.Conn, ch *Channel, timeout time.Duration) *Conn {
	if timeout <= 0 {
		timeout = DefaultFrameTimeout
	}
	return &Conn{c: c, ch: ch, timeout: timeout}
}

// Close closes the connection (a read in progress ends).
func (c *Conn) Close() error { return c.c.Close() }

// Read waits (without a deadline) for a frame to begin, then gives the
// rest of it the frame timeout.
func (c *Conn) Read() (Message, error) {
	_ = c.c.SetReadDeadline(time.Time{})
	began := func() { _ = c.c.SetReadDeadline(time.Now().Add(c.timeout)) }
	if c.ch != nil {
		frame, buf, err := c.ch.ReadRecord(c.c, c.rbuf, began)
		c.rbuf = buf
		if err != nil {
			return nil, err
		}
		return ParseFrame(frame)
	}
	m, buf, err := readFrame(c.c, c.rbuf, began)
	c.rbuf = buf
	return m, err
}

// Send writes m's frame (its record, in a psk session) within the frame
// timeout.
func (c *Conn) Send(m Message) error {
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
