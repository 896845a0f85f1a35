package tcp

import (
	"fmt"
	"hash/crc32"
	"net"
	"sync"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// Sender is the source side's plane. It is safe for concurrent use.
type Sender struct {
	cfg    Config
	stats  counters
	mu     sync.Mutex
	conns  map[*sconn]struct{}        // every open data connection
	idle   map[string][]*sconn        // per address, most recently used last
	byID   map[handoff.PlaneID]*sconn // active or parked, for Finish
	parked map[string]int             // per address, connections waiting for their word
	closed bool
	wg     sync.WaitGroup
}

var _ handoff.SendPlane[[]byte] = (*Sender)(nil)

// NewSender returns a sender plane.
func NewSender(cfg Config) *Sender {
	cfg.defaults()
	if cfg.MaxIdleConns == 0 {
		cfg.MaxIdleConns = DefaultMaxIdleConns
	}
	return &Sender{cfg: cfg, conns: make(map[*sconn]struct{}), idle: make(map[string][]*sconn), byID: make(map[handoff.PlaneID]*sconn), parked: make(map[string]int)}
}

// Send dials the destination named by accept, sends the hello, attaches
// the transfer and streams the regions on a goroutine of its own. The
// transfer resolves when that goroutine's last write has returned.
func (s *Sender) Send(id handoff.PlaneID, regions [][]byte, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	bb := 0
	if len(regions) > 0 {
		bb = len(regions[0])
	}
	for i, r := range regions {
		if len(r) != bb {
			return nil, fmt.Errorf("tcp: region %d of %d bytes, want %d: %w", i, len(r), bb, kvlease.ErrInvalidArgument)
		}
	}
	return s.start(id, accept, attach, func(conn net.Conn, tok [16]byte, sl *seal, cancel *cancelFlag) (int64, error) {
		return s.write(conn, tok, sl, regions, cancel)
	})
}

// checkAddr refuses a data address that is not on the session's peer's
// host nor in AllowDataHosts. A session whose control connection is not
// TCP (a pipe, a Unix socket) has no host to compare: only the allowlist
// applies then, if it is set.
func (s *Sender) checkAddr(id handoff.PlaneID, addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("tcp: accept names %q: %w", addr, ErrCorrupt)
	}
	for _, h := range s.cfg.AllowDataHosts {
		if h == host {
			return nil
		}
	}
	var peerHost string
	if id.Peer != nil {
		if ta, ok := id.Peer.Addr.(*net.TCPAddr); ok {
			peerHost = ta.IP.String()
		}
	}
	if peerHost == "" {
		if len(s.cfg.AllowDataHosts) == 0 {
			return nil
		}
	} else if ip := net.ParseIP(host); ip != nil && ip.String() == peerHost {
		return nil
	}
	s.stats.mu.Lock()
	s.stats.s.RefusedAddr++
	s.stats.mu.Unlock()
	return fmt.Errorf("tcp: accept names data address %s, the session's peer is %s (add the host to Config.AllowDataHosts to allow it): %w", addr, peerHost, ErrAddress)
}

// start is the body of a send, shared by the contiguous and the layered
// planes: it takes an idle data connection to the destination that
// accept names (or dials one), attaches a fresh transfer, and runs write
// on a goroutine of its own whose return resolves the transfer (the
// sender's evidence). write sends the hello first (wrapping a failure to
// write it in helloError), then the frames. Argument checks come before
// it: nothing is dialled for regions that are refused. The connection
// goes back to the pool after a clean transfer (pool.go).
func (s *Sender) start(id handoff.PlaneID, accept []byte, attach func(*kvlease.Transfer) error, write func(conn net.Conn, tok [16]byte, sl *seal, cancel *cancelFlag) (int64, error)) ([]byte, error) {
	addr, tok, err := parseAccept(accept)
	if err != nil {
		return nil, err
	}
	if err := s.checkAddr(id, addr); err != nil {
		return nil, err
	}
	sc, reused, err := s.get(addr)
	if err != nil {
		return nil, err
	}
	cancel := newCancelFlag()
	// The writer writes through st, the transfer's progress timeout
	// (stall.go) on the connection it uses. A cancel stops the writer at
	// the next block boundary (a streaming writer's wait for progress at
	// once), and ends a write blocked on a stalled peer at once (a write
	// deadline in the past, kept there): the writer's return is our
	// evidence either way. Such a connection is never reused.
	st := newStall(s.cfg.StallTimeout)
	st.use(sc.c)
	t := kvlease.NewTransfer(func() {
		cancel.past.Store(true)
		st.stop()
		cancel.set() // after the deadline: a stream writer then sets its own for its stop frame
	})
	if err := attach(t); err != nil {
		// Nothing was written on the connection: it stays good.
		s.mu.Lock()
		keep := s.toIdle(sc)
		s.mu.Unlock()
		if !keep {
			sc.close()
		}
		t.Resolve(err) // nothing read the regions: evidence
		return nil, err
	}
	s.carry(sc, id)
	s.wg.Add(1)
	s.stats.mu.Lock()
	s.stats.s.Started++
	s.stats.mu.Unlock()
	go func() {
		defer s.wg.Done()
		// The session's key is derived here, after Send has returned
		// (the Start message need not wait for it).
		sl, err := newSeal(id, tok)
		var n int64
		if err == nil {
			n, err = write(st, tok, sl, cancel)
		}
		if err != nil && reused && isHelloError(err) && !cancel.Load() {
			// The pooled connection died before the peek could tell
			// (its FIN was still on the way): no block byte left, the
			// regions were not read, the receiver has not taken the
			// token. Dial once more.
			s.stats.mu.Lock()
			s.stats.s.Stale++
			s.stats.mu.Unlock()
			if fresh, derr := s.dial(addr); derr == nil {
				s.replace(sc, fresh)
				sc = fresh
				st.use(sc.c)
				if cancel.Load() {
					n, err = 0, fmt.Errorf("tcp: stopped before the hello: %w", kvlease.ErrCanceled)
				} else {
					n, err = write(st, tok, sl, cancel)
				}
			}
		}
		st.finish()
		s.ended(sc, err == nil && !cancel.Load())
		s.stats.outcome(err, n)
		t.Resolve(err) // the loop has exited: no read of ours is in progress
	}()
	return nil, nil
}

func (s *Sender) write(conn net.Conn, tok [16]byte, sl *seal, regions [][]byte, cancel *cancelFlag) (int64, error) {
	bb := 0
	if len(regions) > 0 {
		bb = len(regions[0])
	}
	fr := frames(nil, regions)
	head := sl.hello(tok, len(regions), bb)
	if len(regions) > 0 {
		head = appendLayout(head, fr)
	}
	if _, err := conn.Write(head); err != nil {
		return 0, helloError{err}
	}
	// One gathered write per frame (a run of adjacent regions; writev
	// on a *net.TCPConn, the run one iovec): the previous frame's check,
	// this frame's header, the run's regions. The check is computed
	// right after the write, over bytes still in cache, which is why it
	// trails its frame. The small buffers and the vector are allocated
	// once per transfer, not per frame; one frame per write keeps a
	// cancel honoured at the next frame boundary.
	maxRun := 0
	for _, n := range fr {
		maxRun = max(maxRun, n)
	}
	tl := sl.trailer()
	if sl.keyed {
		tl = tagLength * maxRun
	}
	metaBuf := make([]byte, tl+frameHeader) // check of frame f-1, header of frame f
	var ahead *tagAhead
	if sl.pipelined(regions) {
		ahead = sl.ahead(regions)
		defer ahead.close() // before the transfer resolves: it reads the regions
	}
	g := newGather(conn)
	iov := make([][]byte, 0, 1+maxRun)
	var n int64
	prev := 0 // the previous frame's check bytes in metaBuf
	i := 0
	for f, run := range fr {
		if cancel.Load() {
			return n, fmt.Errorf("tcp: stopped before block %d of %d: %w", i, len(regions), kvlease.ErrCanceled)
		}
		putFrameHeader(metaBuf[tl:], i, run*bb)
		iov = append(iov[:0], metaBuf[tl-prev:])
		iov = append(iov, regions[i:i+run]...)
		if _, err := g.write(iov); err != nil {
			return n, fmt.Errorf("tcp: block %d of %d (frame %d of %d): %w", i, len(regions), f, len(fr), cancel.or(err))
		}
		prev = sl.checkLen(run)
		s.check(metaBuf[tl-prev:tl], sl, ahead, regions, i, run)
		n += int64(run * bb)
		i += run
	}
	if len(regions) > 0 {
		if _, err := conn.Write(metaBuf[tl-prev : tl]); err != nil {
			return n, fmt.Errorf("tcp: check of block %d of %d: %w", len(regions)-1, len(regions), cancel.or(err))
		}
	}
	return n, nil
}

// check writes into dst the check of the frame of blocks i..i+run-1 (a
// crc32c over the run, or one tag per block: sl.checkLen(run) bytes).
func (s *Sender) check(dst []byte, sl *seal, ahead *tagAhead, regions [][]byte, i, run int) {
	if !sl.keyed {
		var c uint32
		for _, r := range regions[i : i+run] {
			c = crc32.Update(c, castagnoli, r)
		}
		putCRC(dst, c)
		return
	}
	for j := range run {
		if ahead != nil {
			copy(dst[tagLength*j:], ahead.tag(i+j))
		} else {
			sl.sum(dst[tagLength*j:], i+j, regions[i+j])
		}
	}
}

// gather writes a sequence of buffers in order, all of them.
type gather interface {
	write(bufs [][]byte) (int64, error)
}

// plainGather writes one buffer at a time (through a stall, each Write
// gets the progress timeout anew).
type plainGather struct{ c net.Conn }

func (g plainGather) write(bufs [][]byte) (int64, error) {
	var n int64
	for _, b := range bufs {
		if len(b) == 0 {
			continue
		}
		m, err := g.c.Write(b)
		n += int64(m)
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// Close closes every data connection, idle or carrying a handoff (their
// loops then exit and resolve their transfers), and waits for the loops.
// A Send after Close fails (ErrClosed).
func (s *Sender) Close() error {
	s.mu.Lock()
	s.closed = true
	all := make([]*sconn, 0, len(s.conns))
	for sc := range s.conns {
		all = append(all, sc)
	}
	for _, sc := range all {
		s.forget(sc)
	}
	s.mu.Unlock()
	for _, sc := range all {
		sc.close()
	}
	s.wg.Wait()
	return nil
}
