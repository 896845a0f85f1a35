package tcp

import (
	"bufio"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"sync"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/layout"
)

// The layered plane: pools whose blocks are per-layer pieces (a
// layout.Layout over host memory: layout.Host, gpu's LayeredPinned) move a
// block as all its pieces. It is a view over a Sender or a Receiver
// (SendLayered, ReceiveLayered): the same pooled connections, hello,
// tokens, listener, stats, Close and evidence, one data connection at a
// time and one Transfer per handoff (per lease range), as the contiguous
// plane; streaming too (LayeredSender.SendStream). Only the frames'
// contents are gathered and scattered:
//
//   - the sender writes each block as one gathered write (writev on a TCP
//     connection, adjacent pieces one iovec): the frame header and every piece of the block, in
//     (layer, kv) order, straight from source memory; no copy and no
//     allocation per piece or per block;
//   - the receiver reads the frame into the block's pieces through one
//     pooled read buffer per transfer (the pieces are scattered in its
//     memory).
//
// The wire is the contiguous plane's: a block frame's length is the
// layout's BlockBytes and its crc32c covers the pieces in (layer, kv)
// order, i.e. the block in the contiguous layout. So the two planes
// interoperate: a layered sender's blocks arrive block-contiguous in a
// plain []byte pool, and a plain pool's blocks arrive in a layered one,
// piece by piece. Which geometry both sides use is the handoff's
// business: the envelope's Layout, compared at propose time.

// LayeredRegion is a block in a layout, seen piece by piece: the region
// type of a layered pool (layout.Block; gpu.HostBlock).
type LayeredRegion interface {
	// Layout returns the layout of the block's memory; the zero Layout
	// for a zero region.
	Layout() layout.Layout
	// Piece returns piece (layer, kv) of the block.
	Piece(layer, kv int) []byte
}

// LayeredSender is the layered view of a Sender: a
// handoff.SendPlane[R] that sends each block as all its pieces.
type LayeredSender[R LayeredRegion] struct{ s *Sender }

// LayeredReceiver is the layered view of a Receiver: a
// handoff.RecvPlane[R] on the receiver's listener.
type LayeredReceiver[R LayeredRegion] struct{ r *Receiver }

var (
	_ handoff.SendPlane[layout.Block] = LayeredSender[layout.Block]{}
	_ handoff.RecvPlane[layout.Block] = LayeredReceiver[layout.Block]{}
)

// SendLayered returns the layered view of s: its sends share s's
// connections, stats and Close.
func SendLayered[R LayeredRegion](s *Sender) LayeredSender[R] { return LayeredSender[R]{s} }

// ReceiveLayered returns the layered view of r: prepared ids, the
// listener, stats and Close are r's, so one listener serves contiguous
// and layered handoffs alike.
func ReceiveLayered[R LayeredRegion](r *Receiver) LayeredReceiver[R] { return LayeredReceiver[R]{r} }

// regionsLayout returns the layout every region shares (its geometry:
// layout.Layout.Compatible), or an error wrapping
// kvlease.ErrInvalidArgument for a zero region or one that disagrees.
func regionsLayout[R LayeredRegion](regions []R) (layout.Layout, error) {
	var ref layout.Layout
	for i, r := range regions {
		l := r.Layout()
		if l == (layout.Layout{}) {
			return ref, fmt.Errorf("tcp: region %d has no layout: %w", i, kvlease.ErrInvalidArgument)
		}
		if i == 0 {
			ref = l
			continue
		}
		if err := ref.Compatible(l); err != nil {
			return ref, fmt.Errorf("tcp: region %d: %w", i, err)
		}
	}
	return ref, nil
}

// Send implements handoff.SendPlane as Sender.Send does, each block
// written as its pieces. Regions whose layouts disagree are refused with
// kvlease.ErrInvalidArgument before anything is dialled or attached.
func (ls LayeredSender[R]) Send(id handoff.PlaneID, regions []R, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	if _, _, err := parseAccept(accept); err != nil {
		return nil, err
	}
	lay, err := regionsLayout(regions)
	if err != nil {
		return nil, err
	}
	return ls.s.start(id, accept, attach, func(conn net.Conn, tok [16]byte, sl *seal, cancel *cancelFlag) (int64, error) {
		return writeLayered(conn, tok, sl, regions, lay, cancel)
	})
}

func writeLayered[R LayeredRegion](conn net.Conn, tok [16]byte, sl *seal, regions []R, lay layout.Layout, cancel *cancelFlag) (int64, error) {
	bb := 0
	if len(regions) > 0 {
		bb = lay.BlockBytes()
	}
	head := sl.hello(tok, len(regions), bb)
	if len(regions) > 0 {
		// One block per frame: a block's pieces are scattered.
		head = appendUnitLayout(head, len(regions))
	}
	if _, err := conn.Write(head); err != nil {
		return 0, helloError{err}
	}
	// A keyed tag covers the block as one run of bytes: the pieces are
	// gathered into one buffer per transfer for it (the write still goes
	// straight from source memory).
	var gather []byte
	if sl.keyed {
		gather = make([]byte, 0, bb)
	}
	// One frame header, one trailer, one iovec list and one Buffers for
	// the whole transfer: a block costs one vectored write (header, every
	// piece, its trailing crc32c) and no allocation.
	fh := make([]byte, frameHeader+sl.trailer())
	hdr8, trailer := fh[:frameHeader], fh[frameHeader:]
	bufs := make([][]byte, 0, 2+lay.PiecesPerBlock())
	g := newGather(conn)
	var n int64
	for i, r := range regions {
		if cancel.Load() {
			return n, fmt.Errorf("tcp: stopped before block %d of %d: %w", i, len(regions), kvlease.ErrCanceled)
		}
		bufs = append(bufs[:0], hdr8)
		gather = gather[:0]
		var sum uint32
		for l := range lay.Layers {
			for kv := range lay.KVs {
				p, err := piece(r, l, kv, lay, i, len(regions))
				if err != nil {
					return n, err
				}
				if sl.keyed {
					gather = append(gather, p...)
				} else {
					sum = crc32.Update(sum, castagnoli, p)
				}
				bufs = append(bufs, p)
			}
		}
		putFrameHeader(hdr8, i, bb)
		if sl.keyed {
			sl.sum(trailer, i, gather)
		} else {
			putCRC(trailer, sum)
		}
		bufs = append(bufs, trailer)
		if _, err := g.write(bufs); err != nil {
			return n, fmt.Errorf("tcp: block %d of %d: %w", i, len(regions), cancel.or(err))
		}
		n += int64(bb)
	}
	return n, nil
}

// Finish implements handoff.SendPlane as Sender.Finish (the word decides
// whether the data connection is reused).
func (ls LayeredSender[R]) Finish(id handoff.PlaneID, peer error) { ls.s.Finish(id, peer) }

// Prepare implements handoff.RecvPlane as Receiver.Prepare.
func (lr LayeredReceiver[R]) Prepare(id handoff.PlaneID, blocks int) ([]byte, error) {
	return lr.r.Prepare(id, blocks)
}

// Forget implements handoff.RecvPlane as Receiver.Forget.
func (lr LayeredReceiver[R]) Forget(id handoff.PlaneID) { lr.r.Forget(id) }

// Receive implements handoff.RecvPlane as Receiver.Receive does, each
// block read into its pieces. Regions whose layouts disagree are refused
// with kvlease.ErrInvalidArgument before anything is attached (the
// prepared id is dropped, as for a wrong region count).
func (lr LayeredReceiver[R]) Receive(id handoff.PlaneID, regions []R, _ []byte, attach func(*kvlease.Transfer) error) error {
	var lay layout.Layout
	blockBytes := func() (int, error) {
		var err error
		if lay, err = regionsLayout(regions); err != nil || len(regions) == 0 {
			return 0, err
		}
		return lay.BlockBytes(), nil
	}
	return lr.r.receive(id, len(regions), blockBytes, attach, func(c net.Conn, sl *seal, cancel <-chan struct{}) (int64, error) {
		if sl.stream {
			return readStream(c, sl, layeredParts[R]{regions, lay}, cancel)
		}
		return readLayered(c, sl, regions, lay, cancel)
	})
}

// piece returns piece (l, kv) of r, block i of n, refusing one whose
// length is not the layout's (a region that lies about its layout).
func piece[R LayeredRegion](r R, l, kv int, lay layout.Layout, i, n int) ([]byte, error) {
	p := r.Piece(l, kv)
	if len(p) != lay.PieceBytes {
		return nil, fmt.Errorf("tcp: block %d of %d: piece (%d, %d) of %d bytes, want %d: %w",
			i, n, l, kv, len(p), lay.PieceBytes, kvlease.ErrInvalidArgument)
	}
	return p, nil
}

// readBufs pools the receivers' read buffers (one per running transfer).
var readBufs = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 64<<10) }}

func readLayered[R LayeredRegion](c net.Conn, sl *seal, regions []R, lay layout.Layout, cancel <-chan struct{}) (int64, error) {
	if len(regions) == 0 {
		return 0, nil
	}
	bb := lay.BlockBytes()
	// A contiguous sender's frame carries a run of blocks (its layout
	// says how many): its pieces are read block by block, its check
	// follows the whole run (a crc32c over the run, or a tag per block,
	// checked over the run's blocks gathered).
	fr, err := readLayout(c, len(regions), bb)
	if err != nil {
		return 0, byCancel(err, isClosed(cancel))
	}
	maxRun, rest := 0, int64(0)
	for _, run := range fr {
		maxRun = max(maxRun, run)
		rest += int64(frameHeader + run*bb + sl.checkLen(run))
	}
	// The buffer reads no further than this transfer's last byte: the
	// connection may carry the next handoff's hello after it.
	br := readBufs.Get().(*bufio.Reader)
	br.Reset(io.LimitReader(c, rest))
	defer func() {
		br.Reset(nil)
		readBufs.Put(br)
	}()
	var fh [frameHeader]byte
	tr := make([]byte, sl.checkLen(maxRun))
	var n int64
	var gather []byte
	if sl.keyed {
		gather = make([]byte, 0, maxRun*bb)
	}
	i := 0
	for _, run := range fr {
		select {
		case <-cancel:
			return n, fmt.Errorf("tcp: stopped before block %d of %d: %w", i, len(regions), kvlease.ErrCanceled)
		default:
		}
		if _, err := io.ReadFull(br, fh[:]); err != nil {
			return n, fmt.Errorf("tcp: block %d of %d: header: %w", i, len(regions), byCancel(err, isClosed(cancel)))
		}
		if err := checkFrameHeader(fh[:], i, len(regions), run*bb); err != nil {
			return n, err
		}
		var sum uint32
		gather = gather[:0]
		for b := i; b < i+run; b++ {
			r := regions[b]
			for l := range lay.Layers {
				for kv := range lay.KVs {
					p, err := piece(r, l, kv, lay, b, len(regions))
					if err != nil {
						return n, err
					}
					if _, err := io.ReadFull(br, p); err != nil {
						return n, fmt.Errorf("tcp: block %d of %d, piece (%d, %d): %w", b, len(regions), l, kv, byCancel(err, isClosed(cancel)))
					}
					if sl.keyed {
						gather = append(gather, p...)
					} else {
						sum = crc32.Update(sum, castagnoli, p)
					}
				}
			}
		}
		t := tr[:sl.checkLen(run)]
		if _, err := io.ReadFull(br, t); err != nil {
			return n, fmt.Errorf("tcp: block %d of %d: checksum: %w", i+run-1, len(regions), byCancel(err, isClosed(cancel)))
		}
		if sl.keyed {
			for j := range run {
				if err := sl.verify(i+j, gather[j*bb:(j+1)*bb], t[tagLength*j:tagLength*(j+1)]); err != nil {
					return n, fmt.Errorf("tcp: block %d of %d: %w", i+j, len(regions), err)
				}
			}
		} else if want := crcOf(t); sum != want {
			return n, fmt.Errorf("tcp: block %d of %d: crc32c %08x, frame says %08x: %w", i+run-1, len(regions), sum, want, ErrCorrupt)
		}
		n += int64(run * bb)
		i += run
	}
	return n, nil
}
