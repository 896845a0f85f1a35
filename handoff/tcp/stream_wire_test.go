package tcp

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/layout"
)

// rawStream is a hand-made stream sender against a real Receiver: the
// tests write stream frames, good and bad, straight onto the data
// connection.
type rawStream struct {
	t       *testing.T
	sl      *seal
	conn    net.Conn
	src     [][]byte // what the parts hold at the source
	dst     [][]byte // the receiver's regions
	layers  int
	rt      *kvlease.Transfer
	written [][]bool // parts sent in good frames (block, layer)
}

const rawFill = 0x5A // the receiver's regions before the stream

func newRawStream(t *testing.T, keyed bool, n, bb, layers int) *rawStream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := NewReceiver(ln, Config{})
	t.Cleanup(func() { _ = r.Close() })
	srcID, dstID := handoff.PlaneID{Handoff: 1}, handoff.PlaneID{Handoff: 1}
	if keyed {
		srcID, dstID = secureID(t, 1)
	}
	accept, err := r.Prepare(dstID, n)
	if err != nil {
		t.Fatal(err)
	}
	addr, tok, err := parseAccept(accept)
	if err != nil {
		t.Fatal(err)
	}
	s := &rawStream{t: t, layers: layers}
	if s.sl, err = newSeal(srcID, tok); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		src, dst := make([]byte, bb), make([]byte, bb)
		for j := range src {
			src[j], dst[j] = byte(7*i+j%11+1), rawFill
		}
		s.src, s.dst = append(s.src, src), append(s.dst, dst)
		s.written = append(s.written, make([]bool, layers))
	}
	if s.conn, err = net.Dial("tcp", addr); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.conn.Close() })
	head := s.sl.helloFlags(tok, n, bb, flagStream)
	s.write(binary.LittleEndian.AppendUint32(head, uint32(layers)))
	if err := r.Receive(dstID, s.dst, nil, func(t *kvlease.Transfer) error { s.rt = t; return nil }); err != nil {
		t.Fatal(err)
	}
	return s
}

func (s *rawStream) write(b []byte) {
	s.t.Helper()
	if _, err := s.conn.Write(b); err != nil {
		s.t.Fatal(err)
	}
}

// frame returns the frame of layers [l0, l0+nl) of blocks [b0, b0+nb),
// with the right check.
func (s *rawStream) frame(b0, nb, l0, nl int) []byte {
	pb := len(s.src[0]) / s.layers
	h := binary.LittleEndian.AppendUint32(nil, uint32(b0))
	h = binary.LittleEndian.AppendUint32(h, uint32(nb))
	h = binary.LittleEndian.AppendUint16(h, uint16(l0))
	h = binary.LittleEndian.AppendUint16(h, uint16(nl))
	h = binary.LittleEndian.AppendUint32(h, uint32(nb*nl*pb))
	var body, tags []byte
	for b := b0; b < b0+nb; b++ {
		part := s.src[b][l0*pb : (l0+nl)*pb]
		body = append(body, part...)
		if s.sl.keyed {
			tag := make([]byte, tagLength)
			s.sl.sumPart(tag, b, l0, nl, s.layers, part)
			tags = append(tags, tag...)
		}
	}
	if !s.sl.keyed {
		tags = binary.LittleEndian.AppendUint32(nil, crc32.Checksum(body, castagnoli))
	}
	return append(append(h, body...), tags...)
}

// good sends a good frame and records its parts.
func (s *rawStream) good(b0, nb, l0, nl int) {
	s.write(s.frame(b0, nb, l0, nl))
	for b := b0; b < b0+nb; b++ {
		for l := l0; l < l0+nl; l++ {
			s.written[b][l] = true
		}
	}
}

// outcome waits for the receiver's transfer and returns its outcome.
func (s *rawStream) outcome() error {
	s.t.Helper()
	select {
	case <-s.rt.Done():
	case <-time.After(10 * time.Second):
		s.t.Fatal("the receiver's transfer never resolved")
	}
	return s.rt.Err()
}

// untouched checks that every part not sent in a good frame still holds
// the receiver's fill, and every part sent holds the source's bytes:
// nothing was written outside the parts the good frames named.
func (s *rawStream) untouched() {
	s.t.Helper()
	pb := len(s.src[0]) / s.layers
	for b := range s.dst {
		for l := range s.layers {
			got := s.dst[b][l*pb : (l+1)*pb]
			want := bytes.Repeat([]byte{rawFill}, pb)
			if s.written[b][l] {
				want = s.src[b][l*pb : (l+1)*pb]
			}
			if !bytes.Equal(got, want) {
				s.t.Fatalf("block %d, layer %d: written %v, but its bytes are not what that says", b, l, s.written[b][l])
			}
		}
	}
}

// TestStreamFramesAnyOrder: frames in an order no real sender uses (the
// last parts first, runs of blocks and of layers mixed) deliver every
// byte, keyed and unkeyed.
func TestStreamFramesAnyOrder(t *testing.T) {
	for _, keyed := range []bool{false, true} {
		t.Run(fmt.Sprintf("keyed=%v", keyed), func(t *testing.T) {
			s := newRawStream(t, keyed, 6, 1024, 4)
			s.good(5, 1, 3, 1)
			s.good(0, 5, 2, 2) // blocks 0..4, layers 2, 3
			s.good(4, 2, 0, 2)
			s.good(0, 4, 0, 1)
			s.good(0, 4, 1, 1)
			s.good(5, 1, 2, 1)
			if err := s.outcome(); err != nil {
				t.Fatal(err)
			}
			s.untouched()
		})
	}
}

// TestStreamBadFramesRefused: a stream frame out of range, overlapping a
// part already received, of the wrong length, with a bad crc32c, or
// (keyed) with a tag of another block or layer range fails the transfer
// with ErrCorrupt, and nothing outside the good frames' parts is written.
func TestStreamBadFramesRefused(t *testing.T) {
	hdr := func(b0, nb, l0, nl, ln uint32) []byte {
		h := binary.LittleEndian.AppendUint32(nil, b0)
		h = binary.LittleEndian.AppendUint32(h, nb)
		h = binary.LittleEndian.AppendUint16(h, uint16(l0))
		h = binary.LittleEndian.AppendUint16(h, uint16(nl))
		return binary.LittleEndian.AppendUint32(h, ln)
	}
	const n, bb, layers, pb = 4, 1024, 4, 256
	cases := []struct {
		name  string
		keyed bool
		bad   func(s *rawStream) []byte
	}{
		{"duplicate", false, func(s *rawStream) []byte { return s.frame(1, 1, 0, 1) }},
		{"overlap", false, func(s *rawStream) []byte { return s.frame(0, 2, 0, 2) }},
		{"duplicate-keyed", true, func(s *rawStream) []byte { return s.frame(1, 1, 0, 1) }},
		{"block-out-of-range", false, func(*rawStream) []byte { return hdr(3, 2, 0, 1, 2*pb) }},
		{"block-overflow", false, func(*rawStream) []byte { return hdr(0xFFFFFFFE, 4, 0, 1, 4*pb) }},
		{"layer-out-of-range", false, func(*rawStream) []byte { return hdr(0, 1, 3, 2, 2*pb) }},
		{"no-blocks", false, func(*rawStream) []byte { return hdr(0, 0, 0, 1, 0) }},
		{"no-layers", false, func(*rawStream) []byte { return hdr(0, 1, 0, 0, 0) }},
		{"short-length", false, func(*rawStream) []byte { return hdr(2, 1, 0, 1, pb-1) }},
		{"long-length", false, func(*rawStream) []byte { return hdr(2, 1, 0, 1, pb+1) }},
		{"bad-crc", false, func(s *rawStream) []byte {
			f := s.frame(2, 1, 1, 1)
			f[streamHeader+10] ^= 1
			return f
		}},
		{"bad-tag", true, func(s *rawStream) []byte {
			f := s.frame(2, 1, 1, 1)
			f[streamHeader+10] ^= 1
			return f
		}},
		{"tag-of-another-block", true, func(s *rawStream) []byte {
			f := s.frame(2, 1, 1, 1)            // block 2's bytes and tag ...
			binary.LittleEndian.PutUint32(f, 3) // ... named block 3
			copy(f[streamHeader:], s.src[3][pb:2*pb])
			return f
		}},
		{"tag-of-another-layer-range", true, func(s *rawStream) []byte {
			f := s.frame(2, 1, 1, 1)
			binary.LittleEndian.PutUint16(f[8:], 2) // layer 2, with layer 1's tag
			copy(f[streamHeader:], s.src[2][2*pb:3*pb])
			return f
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := newRawStream(t, c.keyed, n, bb, layers)
			s.good(0, 2, 0, 1) // blocks 0, 1, layer 0
			s.good(3, 1, 3, 1)
			s.write(c.bad(s))
			if err := s.outcome(); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("outcome %v, want ErrCorrupt", err)
			}
			// A frame whose check fails was read into its part first
			// (the part the header names, nothing else).
			switch c.name {
			case "bad-crc", "bad-tag":
				s.written[2][1] = true
				s.src[2][pb+10] ^= 1
			case "tag-of-another-block":
				s.written[3][1] = true
			case "tag-of-another-layer-range":
				s.written[2][2] = true
			}
			s.untouched()
		})
	}
}

// TestStreamBadLayerCount: a stream hello followed by a layer count
// that is zero, too large or does not split the blocks fails the
// transfer with ErrCorrupt before a byte is written.
func TestStreamBadLayerCount(t *testing.T) {
	for _, l := range []int{0, 3, handoff.MaxLayers * 2} {
		s := newRawStream(t, false, 2, 1024, l)
		if err := s.outcome(); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("%d layers: outcome %v, want ErrCorrupt", l, err)
		}
		s.layers = 1
		s.written = [][]bool{{false}, {false}}
		s.untouched()
	}
}

// TestStreamStopFrame: after a stop frame the receiver's transfer waits
// for its own cancel (the handoff's abort, on its way over the control
// connection) instead of failing at once, then ends with kvlease.ErrCanceled.
func TestStreamStopFrame(t *testing.T) {
	s := newRawStream(t, false, 2, 1024, 2)
	s.good(0, 2, 0, 1)
	stop := make([]byte, streamHeader)
	binary.LittleEndian.PutUint32(stop, stopBlock)
	s.write(stop)
	select {
	case <-s.rt.Done():
		t.Fatalf("resolved at the stop frame (%v), before its cancel", s.rt.Err())
	case <-time.After(50 * time.Millisecond):
	}
	s.rt.Cancel()
	if err := s.outcome(); !errors.Is(err, kvlease.ErrCanceled) {
		t.Fatalf("outcome %v, want kvlease.ErrCanceled", err)
	}
	s.untouched()
}

// TestStreamHeaderParsesWithoutAllocating: a good header costs no
// allocation.
func TestStreamHeaderParsesWithoutAllocating(t *testing.T) {
	h := binary.LittleEndian.AppendUint32(nil, 1)
	h = binary.LittleEndian.AppendUint32(h, 2)
	h = binary.LittleEndian.AppendUint16(h, 3)
	h = binary.LittleEndian.AppendUint16(h, 4)
	h = binary.LittleEndian.AppendUint32(h, 2*4*64)
	if a := testing.AllocsPerRun(100, func() {
		if _, err := parseStreamHeader(h, 8, 8, 64); err != nil {
			t.Fatal(err)
		}
	}); a != 0 {
		t.Fatalf("%v allocations per header", a)
	}
}

// FuzzStreamHeader: a stream frame header either parses into a frame of
// 1 to maxRunBlocks blocks and at least one layer inside the stream,
// whose length is exactly its parts', or is refused with ErrCorrupt (a
// stop frame with kvlease.ErrCanceled); never a panic. The layer count that
// follows a stream hello is fuzzed alongside.
func FuzzStreamHeader(f *testing.F) {
	good := func(b0, nb, l0, nl, ln uint32) []byte {
		h := binary.LittleEndian.AppendUint32(nil, b0)
		h = binary.LittleEndian.AppendUint32(h, nb)
		h = binary.LittleEndian.AppendUint16(h, uint16(l0))
		h = binary.LittleEndian.AppendUint16(h, uint16(nl))
		return binary.LittleEndian.AppendUint32(h, ln)
	}
	f.Add(good(0, 4, 0, 1, 4*512), 8, 8, 512, []byte{8, 0, 0, 0})
	f.Add(good(7, 1, 7, 1, 512), 8, 8, 512, []byte{0, 0, 0, 0})
	f.Add(good(stopBlock, 0, 0, 0, 0), 8, 8, 512, []byte{3, 0, 0, 0})
	f.Add(good(1, 0xFFFFFFFF, 0, 0xFFFF, 0xFFFFFFFF), 1<<20, 4096, 1, []byte{0xFF, 0xFF, 0xFF, 0xFF})
	f.Add([]byte{1, 2, 3}, 1, 1, 1, []byte{1})
	f.Fuzz(func(t *testing.T, h []byte, blocks, layers, layerBytes int, pre []byte) {
		if blocks < 0 || blocks > 1<<24 || layers < 1 || layers > handoff.MaxLayers || layerBytes < 0 || layerBytes > 1<<24 {
			return
		}
		fr, err := parseStreamHeader(h, blocks, layers, layerBytes)
		switch {
		case errors.Is(err, errStreamStopped):
		case err != nil:
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
		case fr.blocks < 1 || fr.blocks > maxRunBlocks || fr.layers < 1 || fr.block < 0 || fr.layer < 0 ||
			fr.block+fr.blocks > blocks || fr.layer+fr.layers > layers || fr.length != fr.blocks*fr.layers*layerBytes:
			t.Fatalf("header %x for %d blocks × %d layers of %d bytes parsed as %+v", h, blocks, layers, layerBytes, fr)
		}
		bb := layers * layerBytes
		if l, err := parseStreamLayers(pre, bb); err == nil {
			if l < 1 || l > handoff.MaxLayers || bb%l != 0 {
				t.Fatalf("layer count %x over %d-byte blocks parsed as %d", pre, bb, l)
			}
		} else if !errors.Is(err, ErrCorrupt) {
			t.Fatalf("error %v does not wrap ErrCorrupt", err)
		}
	})
}

// TestLayeredPartSpans: a part of a layered region, at any byte range of
// the block's contiguous form (whole pieces, several, or inside one), is
// exactly those bytes of the pieces in (layer, kv) order.
func TestLayeredPartSpans(t *testing.T) {
	lay := layout.LayerSeparated(4, 2, 3, 64, "t")
	h, err := layout.NewHost(lay)
	if err != nil {
		t.Fatal(err)
	}
	for i := range h.Base() {
		h.Base()[i] = byte(i * 7)
	}
	ps := layeredParts[layout.Block]{regions: []layout.Block{h.Region(0), h.Region(1), h.Region(2)}, lay: lay}
	for b := range 3 {
		var whole []byte
		for _, p := range h.Region(kvlease.BlockID(b)).AppendPieces(nil) {
			whole = append(whole, p...)
		}
		for _, r := range [][2]int{{0, 512}, {0, 64}, {128, 256}, {32, 64}, {96, 200}, {500, 12}} {
			spans, err := ps.spans(nil, b, r[0], r[1])
			if err != nil {
				t.Fatal(err)
			}
			if got := bytes.Join(spans, nil); !bytes.Equal(got, whole[r[0]:r[0]+r[1]]) {
				t.Fatalf("block %d, bytes %d+%d: spans hold other bytes", b, r[0], r[1])
			}
		}
	}
}

// TestStreamReadNamesItsEnd: the stream reader names why a read ended the
// way every reader of this package does (byCancel): ErrCanceled only when
// the cancel's deadline ended it; a connection that died keeps its own
// cause even after a cancel (the plane counts it failed, not canceled).
func TestStreamReadNamesItsEnd(t *testing.T) {
	sl, err := newSeal(handoff.PlaneID{Handoff: 1}, [16]byte{1})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name            string
		died, cancelled bool
		wantCanceled    bool
	}{
		{"deadline-after-cancel", false, true, true},
		{"deadline-alone", false, false, false},
		{"died-after-cancel", true, true, false},
		{"died", true, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			peer, conn := loopbackPair(t)
			if c.died {
				_ = peer.Close()
				_ = conn.SetDeadline(time.Now().Add(10 * time.Second)) // EOF comes first
			} else {
				_ = conn.SetDeadline(time.Now()) // as a cancel sets it
			}
			cancel := make(chan struct{})
			if c.cancelled {
				close(cancel)
			}
			_, err = readStream(conn, sl, flatParts{make([]byte, 64)}, cancel)
			if err == nil {
				t.Fatal("a stream read nothing and succeeded")
			}
			if got := errors.Is(err, kvlease.ErrCanceled); got != c.wantCanceled {
				t.Errorf("%v: ErrCanceled %v, want %v", err, got, c.wantCanceled)
			}
			if c.died && errors.Is(err, os.ErrDeadlineExceeded) {
				t.Errorf("%v: a died connection reported as a deadline", err)
			}
		})
	}
}

// TestStreamWriteStopsAtItsCancel: a cancel sets its write deadline in
// the past before it raises its flag. A frame write that deadline ends
// in between is still the cancel's: the writer names it ErrCanceled and,
// at a frame boundary (nothing of the frame written), sends the stop
// frame, so the receiver waits for its own cancel (both sides of a
// source's abort end Aborted) instead of reading a closed connection.
func TestStreamWriteStopsAtItsCancel(t *testing.T) {
	sl, err := newSeal(handoff.PlaneID{Handoff: 1}, [16]byte{1})
	if err != nil {
		t.Fatal(err)
	}
	c, peer := loopbackPair(t)

	cancel := newCancelFlag()
	cancel.past.Store(true) // the hook's first step: its flag is not raised yet
	_ = c.SetWriteDeadline(time.Now())
	ps := flatParts{make([]byte, 64), make([]byte, 64)}
	w := &streamWriter{conn: c, g: newGather(c), sl: sl, ps: ps, layers: 1, pb: 64,
		meta: make([]byte, streamHeader+sl.checkLen(maxRunBlocks))}
	err = w.send(0, 2, 0, 1, cancel)
	if !errors.Is(err, kvlease.ErrCanceled) || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a write the cancel's deadline ended: %v", err)
	}
	_ = c.Close()
	_ = peer.SetReadDeadline(time.Now().Add(10 * time.Second))
	h := make([]byte, streamHeader)
	if _, err := io.ReadFull(peer, h); err != nil {
		t.Fatalf("no stop frame: %v", err)
	}
	if _, err := parseStreamHeader(h, 2, 1, 64); !errors.Is(err, errStreamStopped) {
		t.Fatalf("the frame after the cancel: %v", err)
	}
}

// loopbackPair is a connected pair of TCP connections on 127.0.0.1
// (dialled, accepted), closed when the test ends.
func loopbackPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	dialled, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dialled.Close() })
	accepted, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = accepted.Close() })
	return dialled, accepted
}
