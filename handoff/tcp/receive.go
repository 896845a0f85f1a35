package tcp

import (
	"crypto/rand"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/internal/pending"

	"go.uber.org/atomic"
)

// batchBlocks is the most blocks one scattered read fills.
const batchBlocks = 16

// Receiver is the destination side's plane: it owns a listener for data
// connections. It is safe for concurrent use.
type Receiver struct {
	cfg   Config
	ln    net.Listener
	addr  string
	stats counters

	waiting *pending.Set  // connections waiting for their first hello
	idle    atomic.Int32  // connections waiting for their next hello
	closing chan struct{} // closed by Close

	mu      sync.Mutex
	byTok   map[[16]byte]*slot
	byID    map[handoff.PlaneID]*slot
	conns   map[net.Conn]struct{}
	closed  bool
	wg      sync.WaitGroup
	stopped chan struct{}
}

// slot is one prepared handoff.
type slot struct {
	id     handoff.PlaneID
	tok    [16]byte
	seal   *seal
	blocks int
	conn   chan dataConn // the data connection, once its hello checked out

	mu      sync.Mutex
	dropped bool // no receive will take conn any more
}

// offer hands the connection p, whose hello named s, to the slot's
// receive; a slot dropped meanwhile (a timeout, a cancel, Forget)
// closes it instead.
func (s *slot) offer(r *Receiver, p dataConn) {
	s.mu.Lock()
	if !s.dropped {
		s.conn <- p // buffered: one hello per slot
		s.mu.Unlock()
		return
	}
	s.mu.Unlock()
	r.untrack(p.raw)
}

// drop marks the slot dropped and closes a connection that waited in
// it.
func (s *slot) drop(r *Receiver) {
	s.mu.Lock()
	s.dropped = true
	s.mu.Unlock()
	select {
	case c := <-s.conn:
		r.untrack(c.raw)
	default:
	}
}

var _ handoff.RecvPlane[[]byte] = (*Receiver)(nil)

// NewReceiver serves data connections on ln until Close.
func NewReceiver(ln net.Listener, cfg Config) *Receiver {
	cfg.defaults()
	if cfg.MaxIdleConns == 0 {
		cfg.MaxIdleConns = DefaultReceiverIdleConns
	}
	r := &Receiver{cfg: cfg, ln: ln, addr: ln.Addr().String(), waiting: pending.New(cfg.MaxPendingHellos, cfg.MaxPendingHellosPerHost), byTok: make(map[[16]byte]*slot),
		byID: make(map[handoff.PlaneID]*slot), conns: make(map[net.Conn]struct{}), stopped: make(chan struct{}), closing: make(chan struct{})}
	go r.acceptLoop()
	return r
}

// Addr returns the data listener's address.
func (r *Receiver) Addr() string { return r.addr }

// acceptLoop accepts data connections until Close. An accept error
// other than the closed listener (EMFILE, a connection reset before it
// was accepted) is counted and retried after a backoff that doubles from
// 5 ms to 1 s. Connections waiting for their first hello are bounded
// per host (MaxPendingHellosPerHost) and in all (MaxPendingHellos).
func (r *Receiver) acceptLoop() {
	defer close(r.stopped)
	var backoff time.Duration
	for {
		c, err := r.ln.Accept()
		if err != nil {
			r.mu.Lock()
			closed := r.closed
			r.mu.Unlock()
			if closed || errors.Is(err, net.ErrClosed) {
				return
			}
			r.stats.mu.Lock()
			r.stats.s.AcceptErrors++
			r.stats.mu.Unlock()
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			if r.cfg.OnError != nil {
				r.cfg.OnError(fmt.Errorf("tcp: accept (retrying in %v): %w", backoff, err))
			}
			select {
			case <-time.After(backoff):
			case <-r.closing:
				return
			}
			continue
		}
		backoff = 0
		t, gaveWay := r.waiting.Admit(c.RemoteAddr(), c)
		if gaveWay {
			r.busy()
		}
		if t == nil {
			r.busy()
			_ = c.Close()
			continue
		}
		if !r.track(c) {
			t.Release()
			_ = c.Close()
			return
		}
		r.stats.mu.Lock()
		r.stats.s.Dials++
		r.stats.mu.Unlock()
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			r.firstHello(r.cfg.wrap(c), c, t)
		}()
	}
}

// busy counts a connection closed to keep to the pending caps.
func (r *Receiver) busy() {
	r.stats.mu.Lock()
	r.stats.s.RefusedBusy++
	r.stats.s.Refused++
	r.stats.mu.Unlock()
}

func (r *Receiver) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.conns[c] = struct{}{}
	return true
}

func (r *Receiver) untrack(c net.Conn) {
	r.mu.Lock()
	delete(r.conns, c)
	r.mu.Unlock()
	_ = c.Close()
}

func (r *Receiver) refuse(raw net.Conn, why error) {
	r.untrack(raw)
	r.stats.mu.Lock()
	r.stats.s.Refused++
	if errors.Is(why, ErrUnauthenticated) {
		r.stats.s.RefusedAuth++
	}
	r.stats.mu.Unlock()
	if r.cfg.OnError != nil {
		r.cfg.OnError(fmt.Errorf("tcp: data connection from %v refused: %w", raw.RemoteAddr(), why))
	}
}

// firstHello reads a new data connection's hello within HelloTimeout,
// gives its place among the waiting connections (t) back, and takes the
// hello (hello). A connection closed meanwhile to make room for others
// was counted then (Stats.RefusedBusy).
func (r *Receiver) firstHello(c, raw net.Conn, t *pending.Ticket) {
	var h [helloLength]byte
	_ = c.SetReadDeadline(time.Now().Add(r.cfg.HelloTimeout))
	n, err := io.ReadFull(c, h[:])
	if !t.Release() {
		r.untrack(raw)
		return
	}
	if err != nil {
		r.refuse(raw, fmt.Errorf("half a hello (%d of %d bytes): %w (%w)", n, helloLength, ErrCorrupt, err))
		return
	}
	r.takeHello(c, raw, &h, false)
}

// hello reads and checks the next hello on a reused connection (its
// previous transfer ended cleanly; reused is always true), then hands it
// to its slot. The connection is idle until the hello's first byte: it
// waits for it up to twice IdleTimeout and is closed quietly when the
// time is up (Stats.IdleExpired) or the sender closes it; the rest of
// the hello then comes within HelloTimeout, as on a fresh connection.
func (r *Receiver) hello(c, raw net.Conn, reused bool) {
	var h [helloLength]byte
	if reused {
		_ = c.SetReadDeadline(time.Now().Add(2 * r.cfg.IdleTimeout))
		got, err := c.Read(h[:]) // usually the whole hello at once
		r.idle.Add(-1)
		if got == 0 && err == nil {
			err = io.ErrNoProgress
		}
		if got == 0 {
			r.untrack(raw) // first: a counted expiry is a closed connection
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				r.stats.mu.Lock()
				r.stats.s.IdleExpired++
				r.stats.mu.Unlock()
			}
			return
		}
		if got < helloLength {
			_ = c.SetReadDeadline(time.Now().Add(r.cfg.HelloTimeout))
			if n, err := io.ReadFull(c, h[got:]); err != nil {
				r.refuse(raw, fmt.Errorf("half a hello (%d of %d bytes): %w (%w)", got+n, helloLength, ErrCorrupt, err))
				return
			}
		}
	}
	r.takeHello(c, raw, &h, reused)
}

// takeHello checks a data connection's hello h and hands the connection
// to its slot. Anything else (garbage, an unknown token, a second
// connection for a slot) closes it.
func (r *Receiver) takeHello(c, raw net.Conn, h *[helloLength]byte, reused bool) {
	p, err := parseHello(h)
	if err != nil {
		r.refuse(raw, err)
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	r.mu.Lock()
	s := r.byTok[p.tok]
	switch {
	case s == nil || s.blocks != p.blocks:
		err = fmt.Errorf("hello for %d blocks names no prepared handoff: %w", p.blocks, ErrCorrupt)
	default:
		// A hello that does not prove the session leaves the slot to
		// the real sender.
		if err = s.seal.checkHello(h[:]); err == nil {
			delete(r.byTok, p.tok) // one connection per slot
		}
	}
	r.mu.Unlock()
	if err != nil {
		r.refuse(raw, err)
		return
	}
	if reused {
		r.stats.mu.Lock()
		r.stats.s.Reuses++
		r.stats.mu.Unlock()
	}
	s.offer(r, dataConn{c: c, raw: raw, bb: int64(p.bb), flags: p.flags})
}

// keep is told that the transfer on a data connection ended: cleanly
// (every byte read and checked, no cancel) or not. It reports whether
// the connection is kept to wait, idle, for its next hello (a clean one,
// while fewer than MaxIdleConns wait); any other is closed now, before
// the transfer resolves, so that the sender's peek sees the close by the
// time the destination's word arrives.
func (r *Receiver) keep(p dataConn, clean bool) bool {
	if clean && r.cfg.MaxIdleConns >= 0 {
		if r.idle.Add(1) <= int32(r.cfg.MaxIdleConns) {
			return true
		}
		r.idle.Add(-1)
	}
	r.untrack(p.raw)
	return false
}

// dataConn is a data connection whose hello checked out: the connection
// to read (wrapped), the raw one (tracked for Close), and the block bytes
// its hello announced.
type dataConn struct {
	c, raw net.Conn
	bb     int64
	flags  byte // the hello's flags (flagStream: stream.go)
}

// checkBlockBytes refuses a data connection whose hello announced blocks
// of another size than the receiver's regions (bb).
func (d dataConn) checkBlockBytes(bb int) error {
	if d.bb != int64(bb) {
		return fmt.Errorf("tcp: the hello announces blocks of %d bytes, the regions hold %d: %w", d.bb, bb, ErrCorrupt)
	}
	return nil
}

// Prepare implements handoff.RecvPlane: it draws a token and returns the
// listener's address and the token.
func (r *Receiver) Prepare(id handoff.PlaneID, blocks int) ([]byte, error) {
	var tok [16]byte
	if _, err := rand.Read(tok[:]); err != nil {
		return nil, err
	}
	sl, err := newSeal(id, tok)
	if err != nil {
		return nil, err
	}
	s := &slot{id: id, tok: tok, seal: sl, blocks: blocks, conn: make(chan dataConn, 1)}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, fmt.Errorf("tcp: prepare: %w", ErrClosed)
	}
	if _, dup := r.byID[id]; dup {
		return nil, fmt.Errorf("tcp: prepare: %v already prepared: %w", id, kvlease.ErrInvalidArgument)
	}
	r.byID[id] = s
	r.byTok[tok] = s
	return appendAccept(nil, r.addr, tok), nil
}

// Forget implements handoff.RecvPlane.
func (r *Receiver) Forget(id handoff.PlaneID) {
	r.mu.Lock()
	s := r.byID[id]
	if s != nil {
		delete(r.byID, id)
		delete(r.byTok, s.tok)
	}
	r.mu.Unlock()
	if s != nil {
		s.drop(r)
	}
}

// Receive implements handoff.RecvPlane: it attaches the transfer and
// reads the blocks into regions on a goroutine of its own, once the
// source's data connection has arrived. The transfer resolves when that
// goroutine has exited.
func (r *Receiver) Receive(id handoff.PlaneID, regions [][]byte, _ []byte, attach func(*kvlease.Transfer) error) error {
	blockBytes := func() (int, error) {
		if len(regions) == 0 {
			return 0, nil
		}
		return len(regions[0]), nil
	}
	return r.receive(id, len(regions), blockBytes, attach, func(c net.Conn, sl *seal, cancel <-chan struct{}) (int64, error) {
		if sl.stream {
			return readStream(c, sl, flatParts(regions), cancel)
		}
		return r.read(c, sl, regions, cancel)
	})
}

// receive is the body of a receive, shared by the contiguous and the
// layered planes: it takes the prepared slot for id (blocks regions),
// runs blockBytes (which checks the regions and returns their block
// bytes), attaches a fresh transfer, and waits on a goroutine of its own
// for the data connection, checks that its hello announced blocks of
// that size, and runs read on it; the goroutine's return resolves the
// transfer (the receiver's evidence). A refusal before the attach drops
// the prepared slot.
func (r *Receiver) receive(id handoff.PlaneID, blocks int, blockBytes func() (int, error), attach func(*kvlease.Transfer) error,
	read func(c net.Conn, sl *seal, cancel <-chan struct{}) (int64, error)) error {
	r.mu.Lock()
	s := r.byID[id]
	delete(r.byID, id)
	r.mu.Unlock()
	if s == nil {
		return fmt.Errorf("tcp: receive: %v not prepared: %w", id, kvlease.ErrInvalidArgument)
	}
	if blocks != s.blocks {
		r.dropSlot(s)
		return fmt.Errorf("tcp: receive: %d regions for %d prepared blocks: %w", blocks, s.blocks, kvlease.ErrInvalidArgument)
	}
	bb, err := blockBytes()
	if err != nil {
		r.dropSlot(s)
		return fmt.Errorf("tcp: receive: %w", err)
	}
	// The reader reads through st, the transfer's progress timeout
	// (stall.go). A cancel ends a read blocked on a stalled peer at once
	// (a read deadline in the past, set by a goroutine the hook starts:
	// the hook may be called from inside the read, and the read stops at
	// its next system call, not within the hook): the reader's return is
	// then our evidence, so a quarantine lifts as soon as it is set. Once
	// the read has returned the connection is left alone (it may be
	// reused); a connection whose transfer saw a cancel is closed.
	cancel := make(chan struct{})
	st := newStall(r.cfg.StallTimeout)
	var mu sync.Mutex
	canceled := false
	t := kvlease.NewTransfer(func() {
		mu.Lock()
		defer mu.Unlock()
		if canceled {
			return
		}
		canceled = true
		close(cancel)
		go st.stop()
	})
	if err := attach(t); err != nil {
		r.dropSlot(s)
		t.Resolve(err)
		return err
	}
	r.stats.mu.Lock()
	r.stats.s.Started++
	r.stats.mu.Unlock()
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		var n int64
		var err error
		var kept *dataConn // reused for the next hello once resolved
		wait := time.NewTimer(r.cfg.HelloTimeout)
		defer wait.Stop()
		select {
		case p := <-s.conn:
			if err = p.checkBlockBytes(bb); err != nil {
				r.untrack(p.raw)
				break
			}
			st.use(p.c)
			n, err = read(st, s.seal.mode(p.flags), cancel)
			st.finish()
			mu.Lock()
			clean := err == nil && !canceled
			mu.Unlock()
			if r.keep(p, clean) {
				kept = &p
			}
		case <-cancel:
			err = fmt.Errorf("tcp: canceled before the data connection came: %w", kvlease.ErrCanceled)
			r.dropSlot(s)
		case <-r.stopped:
			err = fmt.Errorf("tcp: receive: %w", ErrClosed)
			r.dropSlot(s)
		case <-wait.C:
			err = fmt.Errorf("tcp: receive: no data connection within %v: %w", r.cfg.HelloTimeout, ErrNoData)
			r.dropSlot(s)
		}
		r.stats.outcome(err, n)
		t.Resolve(err) // the loop has exited: no write of ours is in progress
		if kept != nil {
			r.hello(kept.c, kept.raw, true) // this goroutine waits for the next one
		}
	}()
	return nil
}

func (r *Receiver) dropSlot(s *slot) {
	r.mu.Lock()
	delete(r.byTok, s.tok)
	r.mu.Unlock()
	s.drop(r)
}

// read receives the blocks into regions: first the sender's frame
// layout (how many blocks each frame carries), then the frames, each
// header and check into a small buffer, each block straight into its
// region, several frames per system call where the connection allows
// (readv, with the regions adjacent in memory merged into one iovec).
// Each header is checked when it is complete; an unkeyed frame's crc32c
// follows its bytes as they arrive (no second pass) and is checked when
// the frame is, a keyed frame's tags (one per block) then too. Cancel is
// honoured before each read; a read in progress is not interrupted.
func (r *Receiver) read(c net.Conn, sl *seal, regions [][]byte, cancel <-chan struct{}) (n int64, err error) {
	if len(regions) == 0 {
		return 0, nil
	}
	bb := len(regions[0])
	fr, err := readLayout(c, len(regions), bb)
	if err != nil {
		return 0, byCancel(err, isClosed(cancel))
	}
	var behind *checkBehind
	if sl.pipelined(regions) {
		behind = sl.behind(regions)
		defer func() {
			// Every block read is checked before the transfer resolves
			// (and the checker no longer reads the regions).
			if bad := behind.close(); bad != nil {
				err = bad
			}
		}()
	}
	maxRun := 0
	for _, run := range fr {
		maxRun = max(maxRun, run)
	}
	metaLen := frameHeader + sl.checkLen(maxRun)
	k := min(len(fr), batchBlocks)
	metas := make([]byte, metaLen*k) // frame g's header and check in slot g%k
	meta := func(g int) []byte { return metas[metaLen*(g%k) : metaLen*(g%k+1)] }
	maxBufs := maxRun + 2 + 3*batchBlocks
	sc := newScatter(c, maxBufs)
	bufs := make([][]byte, 0, maxBufs)
	f, first, pos := 0, 0, 0 // the current frame, its first block, how far into it we are
	var got uint32           // its crc32c so far
	for f < len(fr) {
		select {
		case <-cancel:
			return n, fmt.Errorf("tcp: stopped before block %d of %d: %w", first, len(regions), kvlease.ErrCanceled)
		default:
		}
		if behind != nil && behind.failed() != nil {
			return n, nil // the deferred close returns the failure
		}
		bufs = bufs[:0]
		for g, b := f, first; g < min(len(fr), f+k) && (g == f || len(bufs)+fr[g]+2 <= maxBufs); g++ {
			p := 0
			if g == f {
				p = pos
			}
			m, run := meta(g), fr[g]
			body := run * bb
			if p < frameHeader {
				bufs = append(bufs, m[p:frameHeader])
				p = frameHeader
			}
			if p < frameHeader+body {
				off := p - frameHeader
				bufs = append(bufs, regions[b+off/bb][off%bb:])
				bufs = append(bufs, regions[b+off/bb+1:b+run]...)
				p = frameHeader + body
			}
			bufs = append(bufs, m[p-body:frameHeader+sl.checkLen(run)])
			b += run
		}
		m, err := sc.read(bufs)
		if m == 0 && err == nil {
			err = io.ErrNoProgress
		}
		for m > 0 {
			run := fr[f]
			body, cl := run*bb, sl.checkLen(run)
			switch {
			case pos < frameHeader:
				t := min(m, frameHeader-pos)
				pos, m = pos+t, m-t
				if pos < frameHeader {
					continue
				}
				if err := checkFrameHeader(meta(f), first, len(regions), body); err != nil {
					return n, err
				}
			case pos < frameHeader+body:
				off := pos - frameHeader
				o := off % bb
				t := min(m, bb-o)
				if !sl.keyed {
					got = crc32.Update(got, castagnoli, regions[first+off/bb][o:o+t])
				}
				pos, m = pos+t, m-t
			default:
				t := min(m, frameHeader+body+cl-pos)
				pos, m = pos+t, m-t
				if pos < frameHeader+body+cl {
					continue
				}
				check := meta(f)[frameHeader : frameHeader+cl]
				if err := r.verify(sl, behind, regions, first, run, check, got); err != nil {
					return n, err
				}
				n += int64(body)
				f, first, pos, got = f+1, first+run, 0, 0
			}
		}
		if err != nil && f < len(fr) {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return n, fmt.Errorf("tcp: block %d of %d: %d of %d frame bytes: %w", first, len(regions), pos, frameHeader+fr[f]*bb+sl.checkLen(fr[f]), byCancel(err, isClosed(cancel)))
		}
	}
	return n, nil
}

// verify checks the frame of blocks first..first+run-1 against its check:
// got (the crc32c of its bytes) or, keyed, each block against its tag,
// inline or queued behind the reader.
func (r *Receiver) verify(sl *seal, behind *checkBehind, regions [][]byte, first, run int, check []byte, got uint32) error {
	if !sl.keyed {
		if sum := crcOf(check); got != sum {
			if run == 1 {
				return fmt.Errorf("tcp: block %d of %d: crc32c %08x, frame says %08x: %w", first, len(regions), got, sum, ErrCorrupt)
			}
			return fmt.Errorf("tcp: blocks %d to %d of %d (one frame): crc32c %08x, frame says %08x: %w", first, first+run-1, len(regions), got, sum, ErrCorrupt)
		}
		return nil
	}
	for j := range run {
		tag := check[tagLength*j : tagLength*(j+1)]
		if behind != nil {
			behind.check(first+j, tag)
		} else if err := sl.verify(first+j, regions[first+j], tag); err != nil {
			return fmt.Errorf("tcp: block %d of %d: %w", first+j, len(regions), err)
		}
	}
	return nil
}

// isClosed reports whether ch is closed (a receive's cancel).
func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// scatter reads into a sequence of buffers, filling them in order; it
// returns how many bytes it read (perhaps fewer than they hold).
type scatter interface {
	read(bufs [][]byte) (int, error)
}

// plainScatter reads into the first buffer with one Read.
type plainScatter struct{ c net.Conn }

func (s plainScatter) read(bufs [][]byte) (int, error) {
	for _, b := range bufs {
		if len(b) > 0 {
			return s.c.Read(b)
		}
	}
	return 0, nil
}

// Close stops the listener, closes every data connection (their loops
// exit and resolve their transfers) and waits for the loops.
func (r *Receiver) Close() error {
	r.mu.Lock()
	if !r.closed {
		close(r.closing)
	}
	r.closed = true
	for c := range r.conns {
		_ = c.Close()
	}
	r.mu.Unlock()
	err := r.ln.Close()
	<-r.stopped
	r.wg.Wait()
	return err
}
