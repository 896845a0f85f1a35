// Package tcp is a pure-Go data plane for cross-process handoffs: the
// source pushes blocks over a TCP data connection to the destination's
// data listener, while the control messages travel on the handoff's
// control connection (package handoff's Source and Destination). Sender
// implements handoff.SendPlane[[]byte], Receiver handoff.RecvPlane[[]byte].
//
// Reused connections. A data connection carries one handoff at a time
// and, after one that ended cleanly on both sides, the next: the sender
// keeps up to Config.MaxIdleConns idle connections per destination data
// address (closed after Config.IdleTimeout idle), a handoff takes one or
// dials, and every handoff opens with its own hello, so each proves its
// session on its own. The receiver, after a clean transfer, reads the
// next hello on the same connection (waiting up to twice IdleTimeout, so
// that the sender expires first). An error, a cancel or a refused hello
// closes the connection (never reused mid-frame); a broken connection
// fails only the handoff on it, and the next handoff dials. See pool.go
// for how the sender avoids a connection the receiver has closed.
//
// Wire. The Accept message's plane bytes are the listener's address and a
// random 16-byte token (they travel inside the authenticated control
// session). Each handoff on a data connection starts with a hello ("KD",
// version, flags, token, block count, block bytes, HMAC-SHA256) that
// must arrive within Config.HelloTimeout of a new connection's accept
// (and a Receive waits no longer than that for its hello: ErrNoData),
// then the frame layout (how many blocks each
// frame carries; see runs.go), then one frame per run of blocks adjacent
// in the sender's memory (one per block where they are scattered): first
// block's index (4 bytes LE), length (4 bytes LE), the run's bytes, and
// its check (a crc32c over the run, or an AES-GMAC tag per block). The
// check trails its frame so that the sender computes it over bytes it has
// just sent and the receiver over bytes it has just read.
//
// Streaming (stream.go). Sender.SendStream and LayeredSender.SendStream
// (handoff.StreamSendPlane) start a handoff whose blocks the prefill is
// still writing: the Start bytes go back at once, and the writer sends
// each part (block, layer) as the handoff.Ready marks it written, never
// before. The hello carries a stream flag and the layer count, and the
// frames name a run of blocks and a range of layers; the receiver, which
// needs no API change, fills a coverage bitmap and refuses a part out of
// range, sent twice or of the wrong length (ErrCorrupt). Checks are a
// crc32c per frame, or keyed an AES-GMAC tag per (block, layer range)
// whose nonce binds both. The evidence is unchanged: each side resolves
// when its own loop has returned, and a cancel also ends the writer's
// wait for progress.
//
// Binding to the session. In an authenticated session (the PlaneID's
// Peer is secure) both sides derive, from the session's secret, the
// handoff id and the token, one key for the hello's HMAC and one for the
// blocks' checks: an AES-GMAC tag (16 bytes) per block with the block
// index as nonce. A hello that does not verify (a stolen, guessed or
// replayed token) is refused (ErrUnauthenticated) and leaves the slot to
// the real sender; a block of another handoff, another session or at
// another index fails its tag (ErrCorrupt) and fails the transfer. The
// sender refuses an Accept whose data address is not on the
// authenticated peer's host (ErrAddress; Config.AllowDataHosts widens
// it). Blocks are authenticated, not encrypted. Without a secure peer
// (an insecure session) the hello carries no MAC and each block a crc32c,
// which catches accidents, not attackers.
//
// A hello announcing blocks of another size than the receiving regions
// fails the transfer (ErrCorrupt) before a byte is read into them.
// Garbage, half a hello or an unknown token on the data port is refused
// (Stats.Refused, Config.OnError) and changes nothing. New connections
// waiting for their first hello are bounded per host and in all: one
// more from a host with Config.MaxPendingHellosPerHost waiting is closed
// at once; when Config.MaxPendingHellos wait, the oldest of the host
// with the most gives way to the new one (unless that host is the new
// one's), so a host that floods the data port cannot keep another out
// (a connection that carried a handoff and waits, idle, for its next
// hello counts under MaxIdleConns instead, for at most twice
// IdleTimeout); the accept loop survives transient errors (EMFILE) with
// a backoff.
//
// Blocks move straight between the leases' regions and the socket: the
// sender hands each run of regions to one gathered write (writev, the run
// one iovec) with its frame header, the receiver reads straight into the
// regions, up to 16 frames per system call (readv, regions adjacent in its
// memory one iovec) on Linux. Nothing is allocated per block. A
// keyed check is computed off the socket's goroutine (ahead of the
// writer, behind the reader) by a goroutine that is joined before the
// transfer resolves.
//
// Evidence. Each side resolves its own kvlease.Transfer only with proof
// about its own memory:
//
//   - the sender's Read resolves when its last read of source memory has
//     returned: its writer goroutine (and its tagger) has exited
//     (finished, failed or cancelled), so no write of ours is in progress;
//   - the receiver's Write resolves when the goroutine writing into its
//     memory (and its checker) has exited (finished, failed or
//     cancelled);
//   - a connection that dies mid-transfer ends in Resolve(err) (Failed)
//     on both sides, because both sides can prove their own goroutines
//     stopped: the dead connection fails the blocked write or read, and
//     the loop returns;
//   - a cancel (an abort, or the handoff's deadline quarantining the
//     transfer: the halves cancel the transfer itself, so this holds
//     with the lease already released) stops the loop at the next block
//     and ends a read or write blocked on a stalled peer at once (a
//     deadline in the past, outcome kvlease.ErrCanceled): the loop's return is
//     the evidence, so a quarantine set by the deadline lifts as soon as
//     the loop has returned, while the peer is still stalled. Only a
//     loop stuck outside the socket (in the process itself) keeps its
//     quarantine until it returns;
//   - a peer that stops reading or writing, with no deadline or a long
//     one, is ended by the plane's own progress timeout
//     (Config.StallTimeout, DefaultStallTimeout): a read that receives
//     no byte, or a write that sends none, for that long fails the
//     transfer (ErrStalled). What counts as progress is a byte moved on
//     the socket, seen by our loop: a read that returns any byte, a
//     write the kernel takes any of; a slow peer that keeps reading is
//     never cut off however long the transfer. The failed read or write
//     has returned, and with it the loop: that return is the evidence,
//     as for a dead connection, and the transfer fails rather than
//     being quarantined. A streaming receiver also waits while the
//     source's prefill computes, so the timeout must cover the longest
//     pause between parts the prefill marks written.
//
// Reuse changes none of this: a connection goes back to the pool only
// once its loop on each side has returned cleanly, and those returns,
// not the connection's fate, resolve the transfers.
//
// Close is the operator's way out: it closes every connection (idle ones
// too), and the loops' return is then the evidence.
package tcp

import (
	"crypto/rand"
	"encoding/binary"
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

var (
	// ErrCorrupt wraps a frame whose index, length or checksum is not what
	// the receiver expects, and a malformed hello.
	ErrCorrupt = errors.New("tcp: corrupt data frame")
	// ErrClosed is the outcome of transfers stopped by Close.
	ErrClosed = errors.New("tcp: plane closed")
	// ErrNoData is the outcome of a receive whose data connection did not
	// arrive within Config.HelloTimeout: nothing was written.
	ErrNoData = errors.New("tcp: data connection never came")
	// ErrUnauthenticated wraps the refusal of a data connection that
	// does not prove it belongs to the handoff's authenticated session (a
	// hello whose MAC does not verify: a stolen, guessed or replayed
	// token; an unkeyed hello for a secure session). It wraps
	// handoff.ErrAuth.
	ErrUnauthenticated = fmt.Errorf("tcp: data connection not of the session: %w", handoff.ErrAuth)
	// ErrAddress wraps a sender's refusal of an Accept whose data address
	// is neither on the authenticated peer's host nor in
	// Config.AllowDataHosts: the blocks go only to the peer the session
	// authenticated. It wraps handoff.ErrAuth.
	ErrAddress = fmt.Errorf("tcp: data address not the authenticated peer's: %w", handoff.ErrAuth)
)

const (
	version     = 3 // 3: frames carry runs, a frame layout follows the hello
	frameHeader = 8 // index, length
)

// DefaultMaxPendingHellos is Config.MaxPendingHellos when zero.
const DefaultMaxPendingHellos = 64

// DefaultMaxPendingHellosPerHost is Config.MaxPendingHellosPerHost when
// zero.
const DefaultMaxPendingHellosPerHost = 16

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Config configures a Sender or a Receiver. The zero value is usable.
type Config struct {
	// DialTimeout bounds the sender's dial (5 s when zero).
	DialTimeout time.Duration
	// HelloTimeout bounds the receiver's wait for a data connection's
	// hello once it is accepted, and a Receive's wait for its data
	// connection (5 s when zero).
	HelloTimeout time.Duration
	// WrapConn, if set, wraps every data connection once, when it is
	// dialled or accepted (tests use it to observe or break the stream;
	// a reused connection carries several handoffs through one wrapper).
	WrapConn func(net.Conn) net.Conn
	// OnError, if set, is told why the receiver refused a data
	// connection (garbage, half a hello, an unknown token: an error
	// wrapping ErrCorrupt; a hello that does not prove its session:
	// ErrUnauthenticated; one past MaxPendingHellos), and why its accept
	// loop backed off. A refusal changes nothing else.
	OnError func(error)
	// AllowDataHosts, on a sender, are hosts (IP addresses or names, as
	// an Accept spells them) that an Accept may name for its data
	// connection besides the host of the session's control connection,
	// which is the only one allowed by default: a source sends blocks
	// only to the peer it authenticated (ErrAddress otherwise).
	AllowDataHosts []string
	// MaxPendingHellos caps the receiver's data connections accepted but
	// not through their first hello yet (DefaultMaxPendingHellos when
	// zero): at the cap, the oldest waiting connection of the host with
	// the most gives way to a new one from a host with fewer (one from
	// the busiest host is closed at once instead; Stats.RefusedBusy
	// counts both). A connection that carried a handoff of an
	// authenticated hello and waits, idle, for its next hello counts
	// under MaxIdleConns instead.
	MaxPendingHellos int
	// MaxPendingHellosPerHost caps those waiting connections per remote
	// host (an IPv4 address, an IPv6 /64; DefaultMaxPendingHellosPerHost
	// when zero): one more from that host is closed at once
	// (Stats.RefusedBusy).
	MaxPendingHellosPerHost int
	// MaxIdleConns caps idle data connections kept for later handoffs:
	// on a sender, per destination data address (DefaultMaxIdleConns when
	// zero); on a receiver, in all (DefaultReceiverIdleConns when zero):
	// one more is closed after its transfer. Negative turns reuse off: a
	// connection closes after its handoff (a dial per handoff).
	MaxIdleConns int
	// IdleTimeout is how long a sender keeps an idle data connection
	// (DefaultIdleTimeout when zero). A receiver waits for the next hello
	// on an idle connection twice as long, so that with the same setting
	// on both sides the sender, which picks connections, closes first.
	IdleTimeout time.Duration
	// StallTimeout is the transfers' progress timeout, on both sides: a
	// read that receives no byte, or a write that sends none, for that
	// long ends its transfer (ErrStalled; Stats.Stalled), whatever the
	// handoff's Deadline, none included. The loop's return is local
	// evidence like any other, so a frozen peer holds our blocks for at
	// most StallTimeout past its last byte. A streaming receiver waits
	// while the source's prefill computes: StallTimeout must cover the
	// longest pause between the parts the prefill marks written.
	// DefaultStallTimeout when zero or negative: it cannot be turned
	// off.
	StallTimeout time.Duration
}

func (c *Config) defaults() {
	if c.MaxPendingHellos <= 0 {
		c.MaxPendingHellos = DefaultMaxPendingHellos
	}
	if c.MaxPendingHellosPerHost <= 0 {
		c.MaxPendingHellosPerHost = DefaultMaxPendingHellosPerHost
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout = 5 * time.Second
	}
	if c.HelloTimeout <= 0 {
		c.HelloTimeout = 5 * time.Second
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = DefaultIdleTimeout
	}
	if c.StallTimeout <= 0 {
		c.StallTimeout = DefaultStallTimeout
	}
}

func (c *Config) wrap(conn net.Conn) net.Conn {
	if c.WrapConn != nil {
		return c.WrapConn(conn)
	}
	return conn
}

// Stats counts what a plane did.
type Stats struct {
	Started, Completed, Failed, Canceled int
	// Stalled counts, of the Failed, the transfers whose data connection
	// made no progress for Config.StallTimeout (ErrStalled).
	Stalled int
	Bytes   int64
	// Refused counts data connections refused for any reason (garbage,
	// an unknown token, an unauthenticated hello, too many pending).
	Refused int
	// RefusedAuth counts those refused because their hello did not prove
	// the session (ErrUnauthenticated).
	RefusedAuth int
	// RefusedBusy counts those closed before their hello to keep to
	// MaxPendingHellosPerHost and MaxPendingHellos: refused at once, or
	// given way to a newer one from another host.
	RefusedBusy int
	// RefusedAddr counts, on a sender, Accepts refused for a data address
	// outside the authenticated peer's host (ErrAddress).
	RefusedAddr int
	// AcceptErrors counts failed accepts of the receiver's listener,
	// retried after a backoff.
	AcceptErrors int
	// Dials counts data connections dialled (a sender) or accepted (a
	// receiver).
	Dials int
	// Reuses counts handoffs carried by a connection that had carried
	// another before: taken from a sender's pool, or a hello accepted on
	// a receiver's idle connection.
	Reuses int
	// IdleExpired counts idle connections closed for their idle timeout
	// (a sender's, parked ones included; a receiver's twice as long).
	IdleExpired int
	// Stale counts, on a sender, idle connections found closed by the
	// receiver when taken, or whose hello could not be written: the
	// handoff dialled a fresh one instead.
	Stale int
	// Idle is the number of idle connections now (a gauge).
	Idle int
}

type counters struct {
	mu sync.Mutex
	s  Stats
}

func (c *counters) outcome(err error, bytes int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.s.Bytes += bytes
	switch {
	case err == nil:
		c.s.Completed++
	case errors.Is(err, kvlease.ErrCanceled):
		c.s.Canceled++
	default:
		c.s.Failed++
		if errors.Is(err, ErrStalled) {
			c.s.Stalled++
		}
	}
}

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

// checkFrameHeader checks a data frame's header (block index, body
// length; frameHeader bytes) against what the receiver expects: block i
// of blocks, of size bytes. A mismatch wraps ErrCorrupt: the sender is
// out of step, and the transfer fails.
func checkFrameHeader(h []byte, i, blocks, size int) error {
	if len(h) < frameHeader {
		return fmt.Errorf("tcp: block %d of %d: frame header of %d bytes: %w", i, blocks, len(h), ErrCorrupt)
	}
	if idx, ln := binary.LittleEndian.Uint32(h[0:]), binary.LittleEndian.Uint32(h[4:]); uint64(idx) != uint64(i) || uint64(ln) != uint64(size) {
		return fmt.Errorf("tcp: block %d of %d: frame says block %d of %d bytes, want %d: %w", i, blocks, idx, ln, size, ErrCorrupt)
	}
	return nil
}

// parseAccept splits an Accept's plane bytes into address and token.
func parseAccept(b []byte) (string, [16]byte, error) {
	var tok [16]byte
	if len(b) < 2 {
		return "", tok, fmt.Errorf("tcp: accept bytes of %d: %w", len(b), ErrCorrupt)
	}
	n := int(binary.LittleEndian.Uint16(b))
	if len(b) != 2+n+16 {
		return "", tok, fmt.Errorf("tcp: accept bytes of %d for an address of %d: %w", len(b), n, ErrCorrupt)
	}
	copy(tok[:], b[2+n:])
	return string(b[2 : 2+n]), tok, nil
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
		binary.LittleEndian.PutUint32(metaBuf[tl:], uint32(i))
		binary.LittleEndian.PutUint32(metaBuf[tl+4:], uint32(run*bb))
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
		binary.LittleEndian.PutUint32(dst, c)
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

// batchBlocks is the most blocks one scattered read fills.
const batchBlocks = 16

// Stats returns what the sender did.
func (s *Sender) Stats() Stats {
	s.mu.Lock()
	idle := 0
	for _, l := range s.idle {
		idle += len(l)
	}
	s.mu.Unlock()
	s.stats.mu.Lock()
	defer s.stats.mu.Unlock()
	st := s.stats.s
	st.Idle = idle
	return st
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
	if h[0] != 'K' || h[1] != 'D' || h[2] != version {
		r.refuse(raw, fmt.Errorf("hello starts %q, want \"KD\" version %d: %w", h[:3], version, ErrCorrupt))
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	var tok [16]byte
	copy(tok[:], h[4:20])
	blocks := int(binary.LittleEndian.Uint32(h[20:]))
	r.mu.Lock()
	s := r.byTok[tok]
	var err error
	switch {
	case s == nil || s.blocks != blocks:
		err = fmt.Errorf("hello for %d blocks names no prepared handoff: %w", blocks, ErrCorrupt)
	default:
		// A hello that does not prove the session leaves the slot to
		// the real sender.
		if err = s.seal.checkHello(h[:]); err == nil {
			delete(r.byTok, tok) // one connection per slot
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
	s.offer(r, dataConn{c: c, raw: raw, bb: int64(binary.LittleEndian.Uint32(h[24:])), flags: h[3]})
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
	b := binary.LittleEndian.AppendUint16(nil, uint16(len(r.addr)))
	b = append(b, r.addr...)
	return append(b, tok[:]...), nil
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
		if sum := binary.LittleEndian.Uint32(check); got != sum {
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

// Stats returns what the receiver did.
func (r *Receiver) Stats() Stats {
	r.stats.mu.Lock()
	defer r.stats.mu.Unlock()
	st := r.stats.s
	st.Idle = int(r.idle.Load())
	return st
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
