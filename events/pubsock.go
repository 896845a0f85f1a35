package events

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"sync"
	"time"

	"go.uber.org/atomic"
)

// pubSocket is a ZeroMQ PUB socket over ZMTP 3.x with the NULL mechanism:
// it binds and accepts subscribers, or dials one peer (a router's bound
// SUB) and redials it when the connection ends. Each subscriber has its
// own queue of at most hwm messages and its own writer goroutine, so a
// subscriber that does not read loses messages (counted) and delays
// nobody; its reader goroutine takes subscriptions, and drops a
// subscriber that holds none for a handshake timeout. Handshakes run on
// their own goroutines with a deadline, at most maxPending at a time;
// at most maxConns subscribers are served; both by remote address too
// (peerTable: perAddr each, and a full table makes room for an address
// that holds fewer). Everything a peer sends is size-checked before it
// is read (zmtp.go).
type pubSocket struct {
	topic []byte
	lim   limits
	log   *slog.Logger
	ln    net.Listener // bind mode
	dial  endpoint     // connect mode

	sockLife
	conns   peerTable[*subConn]        // the established subscribers
	shaking peerTable[net.Conn]        // connections in their handshake
	list    atomic.Pointer[[]*subConn] // the established subscribers, for send (copy on write)

	refused, hwmDrops, idleDrops atomic.Uint64
}

// subConn is one subscriber.
type subConn struct {
	s    *pubSocket
	conn net.Conn
	addr string // peerAddr(conn)

	mu     sync.Mutex
	counts []int64 // subscriptions to topic[:i], by i (others can never match)
	total  int64   // sum of counts
	q      []pubMsg
	busy   int // messages the writer took and has not finished
	notify chan struct{}
	gone   chan struct{} // closed when the connection is dropped
	once   sync.Once

	matches atomic.Bool
}

// pubMsg is one message for a subscriber: a batch (topic, seq, payload)
// or a raw command frame (ctrl).
type pubMsg struct {
	seq     uint64
	payload []byte
	ctrl    []byte
}

func newPubSocket(topic string, lim limits, log *slog.Logger) *pubSocket {
	s := &pubSocket{topic: []byte(topic), lim: lim, log: log, sockLife: newSockLife(),
		conns: newPeerTable[*subConn](lim.perAddr, lim.maxConns), shaking: newPeerTable[net.Conn](lim.perAddr, lim.maxPending)}
	s.list.Store(&[]*subConn{})
	return s
}

// listen binds ep and serves subscribers until close.
func (s *pubSocket) listen(ep endpoint) error {
	ln, err := listenAndAccept(ep, &s.wg, s.done, s.log, "PUB", s.accept)
	s.ln = ln
	return err
}

// connect dials ep (again and again while it fails or after it ends)
// until close.
func (s *pubSocket) connect(ep endpoint) {
	s.dial = ep
	s.wg.Add(1)
	go s.dialLoop()
}

func (s *pubSocket) dialLoop() {
	defer s.wg.Done()
	backoff := 50 * time.Millisecond
	d := net.Dialer{Timeout: s.lim.handshake}
	for {
		select {
		case <-s.done:
			return
		default:
		}
		conn, err := d.Dial(s.dial.network, s.dial.addr)
		if err == nil {
			if !s.reserve(conn) {
				_ = conn.Close()
				return
			}
			if c := s.serveHandshaken(conn, peerAddr(conn), false); c != nil {
				backoff = 50 * time.Millisecond
				select {
				case <-c.gone:
				case <-s.done:
				}
			}
		}
		select {
		case <-s.done:
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

// listenAndAccept binds ep and runs acceptLoop on it in a goroutine
// counted in wg; the listener is nil when binding failed.
func listenAndAccept(ep endpoint, wg *sync.WaitGroup, done <-chan struct{}, log *slog.Logger, what string, serve func(net.Conn)) (net.Listener, error) {
	ln, err := net.Listen(ep.network, ep.addr)
	if err != nil {
		return nil, err
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		acceptLoop(ln, done, log, what, serve)
	}()
	return ln, nil
}

// acceptLoop accepts on ln until done, handing each connection to serve;
// transient errors (out of descriptors) are waited out, never fatal.
func acceptLoop(ln net.Listener, done <-chan struct{}, log *slog.Logger, what string, serve func(net.Conn)) {
	var delay time.Duration
	for {
		conn, err := ln.Accept()
		if err != nil {
			select {
			case <-done:
				return
			default:
			}
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			log.Warn("events: accept failed, retrying", "socket", what, "err", err, "retry", delay)
			select {
			case <-done:
				return
			case <-time.After(delay):
			}
			continue
		}
		delay = 0
		serve(conn)
	}
}

// reserve takes a handshake slot for conn (peerTable's rules); false
// when closed or refused. A connection it displaces is closed: its
// handshake fails and its goroutine counts the refusal.
func (s *pubSocket) reserve(conn net.Conn) bool {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return false
	}
	victim, displaced, ok := s.shaking.admit(peerAddr(conn), conn)
	s.mu.Unlock()
	if displaced {
		_ = victim.Close()
	}
	return ok
}

// accept runs a new connection's handshake on a goroutine of its own
// (never on the accept loop), or refuses it at once when its address
// (or every address) has too many in their handshake.
func (s *pubSocket) accept(conn net.Conn) {
	if !s.reserve(conn) {
		s.refused.Inc()
		_ = conn.Close()
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.serveHandshaken(conn, peerAddr(conn), true)
	}()
}

// serveHandshaken runs the handshake on conn (its slot reserved under
// addr) and, if it succeeds and there is room, starts serving the
// subscriber; nil when the connection was refused, displaced or closed.
func (s *pubSocket) serveHandshaken(conn net.Conn, addr string, asServer bool) *subConn {
	_, r, err := handshake(conn, "PUB", asServer, []string{"SUB", "XSUB"}, s.lim)
	c := &subConn{s: s, conn: conn, addr: addr, counts: make([]int64, len(s.topic)+1),
		notify: make(chan struct{}, 1), gone: make(chan struct{})}
	s.mu.Lock()
	held := s.shaking.remove(addr, conn) // false: displaced (and closed) meanwhile
	var victim *subConn
	displaced, ok := false, false
	live := err == nil && held && !s.closed // handshaken and still wanted
	if live {
		victim, displaced, ok = s.conns.admit(addr, c)
	}
	if !ok {
		s.mu.Unlock()
		if live {
			s.log.Warn("events: subscriber refused: too many", "remote", conn.RemoteAddr(),
				"max", s.lim.maxConns, "max_per_address", s.lim.perAddr)
		}
		s.refused.Inc()
		_ = conn.Close()
		return nil
	}
	s.publishList()
	s.wg.Add(2)
	s.mu.Unlock()
	if displaced {
		s.log.Info("events: subscriber displaced by another address's", "remote", victim.conn.RemoteAddr(), "by", conn.RemoteAddr())
		s.refused.Inc()
		s.drop(victim)
	}
	go c.readLoop(r)
	go c.writeLoop()
	return c
}

// appendBatchHead appends a batch message's frames up to its payload:
// the topic, the seq (8 bytes big-endian) and the header of the payload
// frame of n bytes. The PUB socket and the replay answers share it.
func appendBatchHead(buf, topic []byte, seq uint64, n int) []byte {
	buf = appendFrameHeader(buf, flagMore, len(topic))
	buf = append(buf, topic...)
	buf = appendFrameHeader(buf, flagMore, 8)
	buf = binary.BigEndian.AppendUint64(buf, seq)
	return appendFrameHeader(buf, 0, n)
}

// publishList republishes the subscriber list; s.mu held.
func (s *pubSocket) publishList() {
	l := make([]*subConn, 0, s.conns.len())
	s.conns.each(func(c *subConn) { l = append(l, c) })
	s.list.Store(&l)
}

// drop forgets c and closes its connection (idempotent).
func (s *pubSocket) drop(c *subConn) {
	s.mu.Lock()
	if s.conns.remove(c.addr, c) {
		s.publishList()
	}
	s.mu.Unlock()
	c.once.Do(func() {
		_ = c.conn.Close()
		close(c.gone)
	})
}

// send queues one batch for every subscriber whose subscriptions match
// the topic. It never blocks: a full queue drops the message for that
// subscriber only.
func (s *pubSocket) send(seq uint64, payload []byte) {
	for _, c := range *s.list.Load() {
		if c.matches.Load() {
			c.enqueue(pubMsg{seq: seq, payload: payload})
		}
	}
}

func (c *subConn) enqueue(m pubMsg) {
	c.mu.Lock()
	if len(c.q)+c.busy >= c.s.lim.hwm {
		c.mu.Unlock()
		c.s.hwmDrops.Inc()
		return
	}
	c.q = append(c.q, m)
	c.mu.Unlock()
	select {
	case c.notify <- struct{}{}:
	default:
	}
}

// writeLoop writes c's queue to its connection, a whole queue per flush.
func (c *subConn) writeLoop() {
	defer c.s.wg.Done()
	defer c.s.drop(c)
	w := bufio.NewWriterSize(deadlineWriter{c.conn, c.s.lim.sendTimeout}, 64<<10)
	var batch []pubMsg
	var hdr []byte
	for {
		select {
		case <-c.gone:
			return
		case <-c.notify:
		}
		c.mu.Lock()
		batch, c.q = c.q, batch[:0]
		c.busy = len(batch)
		c.mu.Unlock()
		for i := range batch {
			m := &batch[i]
			if m.ctrl != nil {
				_, _ = w.Write(m.ctrl)
			} else {
				hdr = appendBatchHead(hdr[:0], c.s.topic, m.seq, len(m.payload))
				_, _ = w.Write(hdr)
				_, _ = w.Write(m.payload)
			}
			*m = pubMsg{} // let the payload go
		}
		err := w.Flush()
		c.mu.Lock()
		c.busy = 0
		c.mu.Unlock()
		if err != nil {
			if !isClosedErr(err) {
				c.s.log.Info("events: subscriber dropped", "remote", c.conn.RemoteAddr(), "err", err)
			}
			return
		}
	}
}

// readLoop takes the subscriber's subscriptions (ZMTP 3.0 messages and
// 3.1 SUBSCRIBE/CANCEL commands) and answers PINGs, until the peer
// breaks the protocol or leaves, or holds no subscription for a
// handshake timeout: a subscriber that subscribes to nothing is sent
// nothing, so SendTimeout would never end it, and it would hold its
// place forever.
func (c *subConn) readLoop(r *bufio.Reader) {
	defer c.s.wg.Done()
	defer c.s.drop(c)
	pr := peerReader{r: r, limit: c.s.lim.maxMessage}
	armed := false // a read deadline is set: the subscriber holds nothing
	for {
		if subscribed := c.matches.Load(); subscribed == armed {
			// Set when the last subscription goes (or at once), cleared
			// by the first one; anything else the peer sends (a PING)
			// does not move it.
			var at time.Time
			if !subscribed && c.s.lim.handshake > 0 {
				at = time.Now().Add(c.s.lim.handshake)
			}
			if err := c.conn.SetReadDeadline(at); err != nil {
				return
			}
			armed = !subscribed
		}
		cmd, data, frames, err := pr.next()
		if err != nil {
			var ne net.Error
			switch {
			case armed && errors.As(err, &ne) && ne.Timeout():
				c.s.idleDrops.Inc()
				c.s.log.Info("events: subscriber dropped: no subscription", "remote", c.conn.RemoteAddr(), "after", c.s.lim.handshake)
			case !isClosedErr(err):
				c.s.log.Info("events: subscriber closed", "remote", c.conn.RemoteAddr(), "err", err)
			}
			return
		}
		switch {
		case cmd == "SUBSCRIBE":
			c.subscribe(subscription{subscribe: true, topic: data})
		case cmd == "CANCEL":
			c.subscribe(subscription{topic: data})
		case cmd == "PING":
			pong, err := pingReply(nil, data)
			if err != nil {
				return
			}
			c.enqueue(pubMsg{ctrl: pong})
		case cmd == "ERROR":
			return
		case cmd != "": // other commands are ignored (spec 37)
		case len(frames) == 1:
			if sub, ok := parseSubscriptionMessage(frames[0]); ok {
				c.subscribe(sub)
			}
		}
	}
}

// subscribe applies one subscription change. Only prefixes of the topic
// are kept (as counts per length), so a peer cannot grow the state.
func (c *subConn) subscribe(sub subscription) {
	t := c.s.topic
	if len(sub.topic) > len(t) || !bytes.HasPrefix(t, sub.topic) {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	n := &c.counts[len(sub.topic)]
	switch {
	case sub.subscribe:
		*n++
		c.total++
	case *n > 0:
		*n--
		c.total--
	}
	c.matches.Store(c.total > 0)
}

// subscriptions returns the topic prefixes subscribers hold.
func (s *pubSocket) subscriptions() []string {
	var out []string
	for _, c := range *s.list.Load() {
		c.mu.Lock()
		for i, k := range c.counts {
			if k > 0 {
				out = append(out, string(s.topic[:i]))
			}
		}
		c.mu.Unlock()
	}
	return out
}

// addr is the bound address (nil in connect mode).
func (s *pubSocket) addr() net.Addr {
	if s.ln == nil {
		return nil
	}
	return s.ln.Addr()
}

// close stops accepting and dialing, closes every connection and waits
// for every goroutine of the socket.
func (s *pubSocket) close() error {
	var conns []*subConn
	if !s.shut(func() {
		s.conns.each(func(c *subConn) { conns = append(conns, c) })
		s.shaking.each(func(conn net.Conn) {
			_ = conn.Close() // its handshake fails now, not at its deadline
		})
	}) {
		return nil
	}
	var err error
	if s.ln != nil {
		err = s.ln.Close()
	}
	for _, c := range conns {
		s.drop(c)
	}
	s.wg.Wait()
	return err
}

// sockLife is what both sockets share to end once: the lock over their
// connection tables, the closed flag, done (closed on close) and the
// goroutines to wait for.
type sockLife struct {
	mu     sync.Mutex
	closed bool
	done   chan struct{}
	wg     sync.WaitGroup
}

func newSockLife() sockLife { return sockLife{done: make(chan struct{})} }

// shut marks the socket closed, closes done and runs f, all under mu,
// the first time only; false when it was already closed.
func (l *sockLife) shut(f func()) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return false
	}
	l.closed = true
	close(l.done)
	f()
	return true
}
