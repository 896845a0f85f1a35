package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/layout"
	"go.uber.org/atomic"
)

// Stream mode: a streaming handoff (handoff.Streaming) sends the parts of
// its blocks as the prefill marks them written (handoff.Ready), while the
// rest is still being computed. Part (block i, layer j) is the j-th of
// Layers equal slices of block i in its contiguous form (a layered
// region's pieces of those layers, in (layer, kv) order).
//
// Wire. The hello carries flagStream; instead of a frame layout, the
// number of layers follows it (4 bytes LE). Then stream frames, in any
// order the sender chose, until every part has been sent once:
//
//	first block (4 LE) | blocks (4 LE) | first layer (2 LE) | layers (2 LE) | length (4 LE)
//	body: for each block of the run, its layers' bytes (block-major)
//	check: a crc32c over the body, or (keyed) one AES-GMAC tag per block
//
// A frame carries one range of layers of a run of consecutive blocks (at
// most maxRunBlocks blocks and, past its first block, maxRunBytes
// bytes); where the run's bytes are adjacent in memory (whole blocks of
// adjacent regions, a layer of a LayerSeparated layout's adjacent blocks
// with one piece per layer) the gathered write merges them into one
// iovec. A keyed tag's nonce binds the block index, the layer range and
// the layer count, and is never the nonce of a whole-block frame, so no
// nonce repeats under the handoff's key (the receiver refuses a part it
// already has). The receiver keeps a coverage bitmap (blocks × layers
// bits, at most 512 bytes a block): a frame out of range, overlapping a
// received part, or whose length is not its parts' is ErrCorrupt and
// fails the transfer before a byte of its body is read, and nothing is
// ever written outside the parts the header names.

// A sender whose transfer is cancelled between frames (an abort, a
// deadline) ends the stream with a stop frame (first block 0xFFFFFFFF,
// every other field zero) before it closes the connection: the receiver
// then waits up to stopGrace for its own cancel (the handoff's abort,
// which travels on the control connection and may come second) before it
// gives up, so that both sides of a source's abort end Aborted rather
// than the destination Failed by the closed connection. The stop frame
// is not authenticated: whoever could inject it could as well reset the
// connection.

// stopGrace bounds a receiver's wait for its cancel after a stop frame,
// and a sender's write of the stop frame.
const (
	stopGrace      = 5 * time.Second
	stopWriteGrace = 100 * time.Millisecond
)

// maxFrameSpans bounds the spans (iovecs before merging) of one stream
// frame past its first block.
const maxFrameSpans = 1024

// cancelFlag is a send's cancel: the flag the writers poll at frame
// boundaries, and a channel that ends a streaming writer's wait for the
// prefill's progress.
type cancelFlag struct {
	atomic.Bool
	stop chan struct{}
	once sync.Once
	// past is set by the cancel hook before it sets the write deadline
	// in the past (and before the flag itself, which comes after the
	// deadline): a write that fails by that deadline then knows why.
	past atomic.Bool
}

func newCancelFlag() *cancelFlag { return &cancelFlag{stop: make(chan struct{})} }

func (c *cancelFlag) set() {
	c.Store(true)
	c.once.Do(func() { close(c.stop) })
}

// or wraps err, a write's failure, with kvlease.ErrCanceled when the cancel's
// deadline ended the write (see byCancel).
func (c *cancelFlag) or(err error) error { return byCancel(err, c.past.Load()) }

// byCancel wraps err with kvlease.ErrCanceled when it is a deadline's expiry and
// the transfer was cancelled (canceled): the cancel's deadline in the
// past ended the read or write. Any other failure (the connection died,
// even after a cancel) keeps its own cause.
func byCancel(err error, canceled bool) error {
	if canceled && errors.Is(err, os.ErrDeadlineExceeded) {
		return fmt.Errorf("%w (%w)", kvlease.ErrCanceled, err)
	}
	return err
}

// mode returns the seal of a data connection whose hello had flags: s
// itself, or for stream mode a copy of s that says so (the slot's seal
// serves one connection, so the copy's nonce buffer is its own).
func (s *seal) mode(flags byte) *seal {
	if flags&flagStream == 0 {
		return s
	}
	c := *s
	c.stream = true
	return &c
}

// partNonce sets the nonce of the tag of layers [layer, layer+layers) of
// block b, of a stream of total layers: never a whole-block frame's
// nonce (whose bytes 4..11 are zero; here layers ≥ 1).
func (s *seal) partNonce(b, layer, layers, total int) {
	binary.LittleEndian.PutUint32(s.nonce[0:], uint32(b))
	binary.LittleEndian.PutUint16(s.nonce[4:], uint16(layer))
	binary.LittleEndian.PutUint16(s.nonce[6:], uint16(layers))
	binary.LittleEndian.PutUint16(s.nonce[8:], uint16(total))
	s.nonce[10], s.nonce[11] = 'S', 0
}

// sumPart writes the tag of a part's bytes into dst (tagLength bytes).
func (s *seal) sumPart(dst []byte, b, layer, layers, total int, part []byte) {
	s.partNonce(b, layer, layers, total)
	s.gmac.Seal(dst[:0], s.nonce[:], nil, part)
}

// verifyPart checks a part's bytes against its tag.
func (s *seal) verifyPart(b, layer, layers, total int, part, tag []byte) error {
	s.partNonce(b, layer, layers, total)
	if _, err := s.gmac.Open(nil, s.nonce[:], tag, part); err != nil {
		return fmt.Errorf("tcp: block %d, layers %d to %d: its tag does not verify under this handoff's key (corrupt, or from another handoff, session or place): %w",
			b, layer, layer+layers-1, ErrCorrupt)
	}
	return nil
}

// parts is how the stream writer and reader see regions: blocks of
// blockBytes whose contiguous form's byte ranges are spans of memory.
type parts interface {
	count() int
	blockBytes() int
	// spans appends the spans holding bytes [off, off+n) of block b's
	// contiguous form, in order.
	spans(dst [][]byte, b, off, n int) ([][]byte, error)
}

// flatParts are contiguous regions: a part is one span.
type flatParts [][]byte

func (p flatParts) count() int { return len(p) }

func (p flatParts) blockBytes() int {
	if len(p) == 0 {
		return 0
	}
	return len(p[0])
}

func (p flatParts) spans(dst [][]byte, b, off, n int) ([][]byte, error) {
	return append(dst, p[b][off:off+n:off+n]), nil
}

// layeredParts are layered regions: a part is the pieces (or the parts of
// pieces) it covers, in (layer, kv) order.
type layeredParts[R LayeredRegion] struct {
	regions []R
	lay     layout.Layout
}

func (p layeredParts[R]) count() int { return len(p.regions) }

func (p layeredParts[R]) blockBytes() int { return p.lay.BlockBytes() }

func (p layeredParts[R]) spans(dst [][]byte, b, off, n int) ([][]byte, error) {
	pb := p.lay.PieceBytes
	k, o := off/pb, off%pb
	for n > 0 {
		pc, err := piece(p.regions[b], k/p.lay.KVs, k%p.lay.KVs, p.lay, b, len(p.regions))
		if err != nil {
			return dst, err
		}
		t := min(n, pb-o)
		dst = append(dst, pc[o:o+t:o+t])
		n, o, k = n-t, 0, k+1
	}
	return dst, nil
}

// checkStreamLayers refuses a layer count that does not split blocks of
// bb bytes.
func checkStreamLayers(layers, bb int) error {
	if layers < 1 || layers > handoff.MaxLayers || bb%layers != 0 {
		return fmt.Errorf("tcp: stream of %d layers over blocks of %d bytes (1 to %d layers that split the block): %w",
			layers, bb, handoff.MaxLayers, kvlease.ErrInvalidArgument)
	}
	return nil
}

var (
	_ handoff.StreamSendPlane[[]byte]       = (*Sender)(nil)
	_ handoff.StreamSendPlane[layout.Block] = LayeredSender[layout.Block]{}
)

// SendStream implements handoff.StreamSendPlane: Send for regions still
// being written. It dials, attaches and returns the Start bytes at once;
// its writer goroutine then sends each part as ready marks it written
// (stream mode; see stream.go) and never reads a part before. A cancel
// also ends the writer's wait for progress. Regions of unequal lengths,
// or a layer count that does not split them, are refused
// (kvlease.ErrInvalidArgument) before anything is dialled.
func (s *Sender) SendStream(id handoff.PlaneID, regions [][]byte, ready handoff.Ready, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	ps := flatParts(regions)
	bb := ps.blockBytes()
	for i, r := range regions {
		if len(r) != bb {
			return nil, fmt.Errorf("tcp: region %d of %d bytes, want %d: %w", i, len(r), bb, kvlease.ErrInvalidArgument)
		}
	}
	if len(regions) == 0 {
		return s.Send(id, regions, accept, attach)
	}
	if err := checkStreamLayers(ready.Layers(), bb); err != nil {
		return nil, err
	}
	return s.start(id, accept, attach, func(conn net.Conn, tok [16]byte, sl *seal, cancel *cancelFlag) (int64, error) {
		return writeStream(conn, tok, sl, ps, ready, cancel)
	})
}

// SendStream implements handoff.StreamSendPlane as Sender.SendStream
// does, each part written as its pieces. Regions whose layouts disagree
// are refused as by Send.
func (ls LayeredSender[R]) SendStream(id handoff.PlaneID, regions []R, ready handoff.Ready, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	if _, _, err := parseAccept(accept); err != nil {
		return nil, err
	}
	lay, err := regionsLayout(regions)
	if err != nil {
		return nil, err
	}
	if len(regions) == 0 {
		return ls.Send(id, regions, accept, attach)
	}
	if err := checkStreamLayers(ready.Layers(), lay.BlockBytes()); err != nil {
		return nil, err
	}
	return ls.s.start(id, accept, attach, func(conn net.Conn, tok [16]byte, sl *seal, cancel *cancelFlag) (int64, error) {
		return writeStream(conn, tok, sl, layeredParts[R]{regions, lay}, ready, cancel)
	})
}

// streamWriter frames parts onto a data connection.
type streamWriter struct {
	conn     net.Conn
	g        gather
	sl       *seal
	ps       parts
	layers   int
	pb       int      // bytes of one layer of a block
	meta     []byte   // a frame's header, then its check
	iov      [][]byte // a frame: header, spans, check
	gathered []byte   // keyed: a part spread over spans, gathered for its tag
	sent     int64
}

// writeStream sends the hello (stream mode) and the layer count, then,
// as ready marks them written, the parts not sent yet, until all are
// sent. When the marks move from (layers sl, blocks sb) to (L', B'), the
// new parts are layers [sl, L) of blocks [sb, B') and layers [sl, L') of
// blocks [B', n): at most two ranges, each framed by runs of blocks.
func writeStream(conn net.Conn, tok [16]byte, sl *seal, ps parts, ready handoff.Ready, cancel *cancelFlag) (int64, error) {
	n, bb, L := ps.count(), ps.blockBytes(), ready.Layers()
	head := sl.helloFlags(tok, n, bb, flagStream)
	head = appendStreamLayers(head, L)
	if _, err := conn.Write(head); err != nil {
		return 0, helloError{err} // a reused connection's sender redials
	}
	w := &streamWriter{conn: conn, g: newGather(conn), sl: sl, ps: ps, layers: L, pb: bb / L,
		meta: make([]byte, streamHeader+sl.checkLen(maxRunBlocks))}
	doneL, doneB := 0, 0 // sent: layers [0, doneL) of every block, blocks [0, doneB) whole
	for doneL < L && doneB < n {
		l, b, ok := ready.Wait(doneL, doneB, cancel.stop)
		if !ok || cancel.Load() {
			w.stop(w.conn)
			return w.sent, fmt.Errorf("tcp: stopped with %d of %d layers and %d of %d blocks sent: %w", doneL, L, doneB, n, kvlease.ErrCanceled)
		}
		l, b = min(l, L), min(b, n)
		if l == L || ready.Complete() {
			l, b = L, n
		}
		if b > doneB {
			if err := w.send(doneB, b, doneL, L, cancel); err != nil {
				return w.sent, err
			}
		}
		if from := max(doneB, b); l > doneL && from < n {
			if err := w.send(from, n, doneL, l, cancel); err != nil {
				return w.sent, err
			}
		}
		doneL, doneB = max(doneL, l), max(doneB, b)
	}
	return w.sent, nil
}

// stop writes the stop frame, at a frame boundary, under a deadline of
// its own (the cancel set one in the past before it woke us). A failure
// only means the receiver learns of the stop by the closed connection.
func (w *streamWriter) stop(conn net.Conn) {
	h := w.meta[:streamHeader]
	putStopFrame(h)
	_ = conn.SetWriteDeadline(time.Now().Add(stopWriteGrace))
	_, _ = conn.Write(h)
}

// send frames layers [l0, l1) of blocks [b0, b1): one gathered write per
// frame (header, the parts' spans, the check).
func (w *streamWriter) send(b0, b1, l0, l1 int, cancel *cancelFlag) error {
	nl := l1 - l0
	off, partBytes := l0*w.pb, nl*w.pb
	for b := b0; b < b1; {
		if cancel.Load() {
			w.stop(w.conn)
			return fmt.Errorf("tcp: stopped before block %d, layers %d to %d: %w", b, l0, l1-1, kvlease.ErrCanceled)
		}
		w.iov = append(w.iov[:0], w.meta[:streamHeader])
		var sum uint32
		e := b
		for e < b1 && (e == b || (e-b < maxRunBlocks && (e-b+1)*partBytes <= maxRunBytes && len(w.iov) < maxFrameSpans)) {
			k := len(w.iov)
			var err error
			if w.iov, err = w.ps.spans(w.iov, e, off, partBytes); err != nil {
				return err
			}
			part := w.iov[k:]
			if !w.sl.keyed {
				for _, sp := range part {
					sum = crc32.Update(sum, castagnoli, sp)
				}
			} else {
				dst := w.meta[streamHeader+tagLength*(e-b):]
				if len(part) == 1 {
					w.sl.sumPart(dst, e, l0, nl, w.layers, part[0])
				} else {
					w.gathered = w.gathered[:0]
					for _, sp := range part {
						w.gathered = append(w.gathered, sp...)
					}
					w.sl.sumPart(dst, e, l0, nl, w.layers, w.gathered)
				}
			}
			e++
		}
		putStreamHeader(w.meta[:streamHeader], b, e-b, l0, nl, (e-b)*partBytes)
		if !w.sl.keyed {
			putCRC(w.meta[streamHeader:], sum)
		}
		w.iov = append(w.iov, w.meta[streamHeader:streamHeader+w.sl.checkLen(e-b)])
		if m, err := w.g.write(w.iov); err != nil {
			// The cancel sets its deadline (past) before its flag, so
			// a write that deadline ended is named by past, not by the
			// flag, which may not be set yet.
			if err = cancel.or(err); m == 0 && errors.Is(err, kvlease.ErrCanceled) {
				// The cancel's deadline stopped the write before its
				// first byte: still at a frame boundary.
				w.stop(w.conn)
			}
			return fmt.Errorf("tcp: blocks %d to %d, layers %d to %d: %w", b, e-1, l0, l1-1, err)
		}
		w.sent += int64((e - b) * partBytes)
		b = e
	}
	return nil
}

// coverage is the receiver's record of the parts received: one bit per
// (block, layer).
type coverage struct {
	bits   []uint64
	layers int
}

func newCoverage(blocks, layers int) coverage {
	return coverage{bits: make([]uint64, (blocks*layers+63)/64), layers: layers}
}

// claim marks the parts of f received, refusing (ErrCorrupt) a frame that
// overlaps parts already received. f is in range (parseStreamHeader).
func (c coverage) claim(f streamFrame) error {
	for b := f.block; b < f.block+f.blocks; b++ {
		for l := f.layer; l < f.layer+f.layers; l++ {
			i := b*c.layers + l
			if c.bits[i/64]&(1<<(i%64)) != 0 {
				return fmt.Errorf("tcp: stream frame resends block %d, layer %d: %w", b, l, ErrCorrupt)
			}
			c.bits[i/64] |= 1 << (i % 64)
		}
	}
	return nil
}

// readStream receives a stream into ps: the layer count, then frames in
// any order until every part has arrived, each body read straight into
// its parts' bytes and checked once complete. Cancel is honoured before
// each frame; a read blocked on the peer ends by its deadline (receive).
func readStream(c net.Conn, sl *seal, ps parts, cancel <-chan struct{}) (int64, error) {
	n := ps.count()
	if n == 0 {
		return 0, nil
	}
	bb := ps.blockBytes()
	sc := newScatter(c, maxIovecs)
	meta := make([]byte, streamHeader+sl.checkLen(maxRunBlocks))
	var work, bufs [][]byte
	if err := readFullv(sc, &work, append(bufs, meta[:4])); err != nil {
		return 0, fmt.Errorf("tcp: stream layer count: %w", byCancel(err, isClosed(cancel)))
	}
	L, err := parseStreamLayers(meta[:4], bb)
	if err != nil {
		return 0, err
	}
	pb := bb / L
	cov := newCoverage(n, L)
	var gathered []byte
	var got int64
	for left := n * L; left > 0; {
		select {
		case <-cancel:
			return got, fmt.Errorf("tcp: stopped with %d of %d parts to come: %w", left, n*L, kvlease.ErrCanceled)
		default:
		}
		if err := readFullv(sc, &work, append(bufs[:0], meta[:streamHeader])); err != nil {
			return got, fmt.Errorf("tcp: stream frame header (%d of %d parts to come): %w", left, n*L, byCancel(err, isClosed(cancel)))
		}
		f, err := parseStreamHeader(meta[:streamHeader], n, L, pb)
		if errors.Is(err, errStreamStopped) {
			// Our own cancel (the handoff's abort) is on its way.
			t := time.NewTimer(stopGrace)
			defer t.Stop()
			select {
			case <-cancel:
			case <-t.C:
			}
			return got, err
		}
		if err != nil {
			return got, err
		}
		if err := cov.claim(f); err != nil {
			return got, err
		}
		bufs = bufs[:0]
		for b := f.block; b < f.block+f.blocks; b++ {
			if bufs, err = ps.spans(bufs, b, f.layer*pb, f.layers*pb); err != nil {
				return got, err
			}
		}
		check := meta[streamHeader : streamHeader+sl.checkLen(f.blocks)]
		if err := readFullv(sc, &work, append(bufs, check)); err != nil {
			return got, fmt.Errorf("tcp: blocks %d to %d, layers %d to %d: %w", f.block, f.block+f.blocks-1, f.layer, f.layer+f.layers-1, byCancel(err, isClosed(cancel)))
		}
		if !sl.keyed {
			var sum uint32
			for _, sp := range bufs {
				sum = crc32.Update(sum, castagnoli, sp)
			}
			if want := crcOf(check); sum != want {
				return got, fmt.Errorf("tcp: blocks %d to %d, layers %d to %d: crc32c %08x, frame says %08x: %w",
					f.block, f.block+f.blocks-1, f.layer, f.layer+f.layers-1, sum, want, ErrCorrupt)
			}
		} else {
			per := len(bufs) / f.blocks // every part of a frame has the same spans
			for j := range f.blocks {
				part := bufs[j*per : (j+1)*per]
				p := part[0]
				if len(part) > 1 {
					gathered = gathered[:0]
					for _, sp := range part {
						gathered = append(gathered, sp...)
					}
					p = gathered
				}
				if err := sl.verifyPart(f.block+j, f.layer, f.layers, L, p, check[tagLength*j:tagLength*(j+1)]); err != nil {
					return got, err
				}
			}
		}
		got += int64(f.length)
		left -= f.blocks * f.layers
	}
	return got, nil
}

// readFullv fills bufs, in order, from sc (at most maxIovecs buffers per
// system call); work is scratch space reused across calls.
func readFullv(sc scatter, work *[][]byte, bufs [][]byte) error {
	w := append((*work)[:0], bufs...)
	*work = w
	for {
		for len(w) > 0 && len(w[0]) == 0 {
			w = w[1:]
		}
		if len(w) == 0 {
			return nil
		}
		m, err := sc.read(w[:min(len(w), maxIovecs)])
		if m == 0 && err == nil {
			err = io.ErrNoProgress
		}
		for m > 0 {
			t := min(m, len(w[0]))
			w[0], m = w[0][t:], m-t
			if len(w[0]) == 0 {
				w = w[1:]
			}
		}
		if err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			if len(w) > 0 {
				return err
			}
			return nil
		}
	}
}
