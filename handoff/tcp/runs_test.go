package tcp

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// layoutRegions returns n regions of bb bytes from a HostMemory: kind
// "contiguous" (ids 0..n-1, one span), "scattered" (every other id: no
// two adjacent) or "mixed" (runs of 1, 2, 3, ... ids with a gap between
// runs). Each region is filled with its index and seed.
func layoutRegions(t testing.TB, kind string, n, bb int, seed byte) [][]byte {
	t.Helper()
	mem, err := kvlease.NewHostMemory(3*n+2, bb)
	if err != nil {
		t.Fatal(err)
	}
	regions := make([][]byte, 0, n)
	id, run, left := 0, 1, 1
	for len(regions) < n {
		regions = append(regions, mem.Region(kvlease.BlockID(id)))
		switch kind {
		case "contiguous":
			id++
		case "scattered":
			id += 2
		case "mixed":
			id++
			if left--; left == 0 {
				run++
				id, left = id+1, run
			}
		}
	}
	for i, r := range regions {
		for j := range r {
			r[j] = byte(i*7+j) ^ seed
		}
	}
	return regions
}

// wantFrames is the frame layout a sender of n regions of kind uses.
func wantFrames(kind string, n, bb int) []int {
	var fr []int
	switch kind {
	case "scattered":
		for range n {
			fr = append(fr, 1)
		}
	case "contiguous":
		for left := n; left > 0; left -= runCap(bb) {
			fr = append(fr, min(left, runCap(bb)))
		}
	case "mixed":
		for run, left := 1, n; left > 0; run++ {
			fr = append(fr, min(run, left))
			left -= min(run, left)
		}
	}
	return fr
}

// TestFrames: consecutive regions adjacent in memory share a frame, up
// to runCap blocks; regions apart (separate allocations a byte bigger,
// every other block of an arena) get a frame each.
func TestFrames(t *testing.T) {
	const bb = 4096
	for _, kind := range []string{"contiguous", "scattered", "mixed"} {
		for _, n := range []int{1, 7, 256, 300} {
			got := frames(nil, layoutRegions(t, kind, n, bb, 0))
			if want := wantFrames(kind, n, bb); !slices.Equal(got, want) {
				t.Errorf("%s %d: frames %v, want %v", kind, n, got, want)
			}
		}
	}
	apart := make([][]byte, 4)
	for i := range apart {
		apart[i] = make([]byte, bb+1)[:bb]
	}
	if got := frames(nil, apart); !slices.Equal(got, []int{1, 1, 1, 1}) {
		t.Errorf("separate allocations: frames %v", got)
	}
	if got := frames(nil, nil); len(got) != 0 {
		t.Errorf("no regions: frames %v", got)
	}
	if got, want := runCap(64<<10), 16; got != want {
		t.Errorf("runCap(64 KiB) = %d, want %d", got, want)
	}
}

// transfer moves src into dst over a fresh sender and receiver on
// loopback (wrap wraps the sender's data connection) and returns both
// sides' outcomes once both transfers resolved.
func transfer(t testing.TB, srcID, dstID handoff.PlaneID, src, dst [][]byte, wrap func(net.Conn) net.Conn) (sendErr, recvErr error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := NewReceiver(ln, Config{})
	defer r.Close()
	s := NewSender(Config{WrapConn: wrap})
	defer s.Close()
	accept, err := r.Prepare(dstID, len(dst))
	if err != nil {
		t.Fatal(err)
	}
	var st, rt *kvlease.Transfer
	if _, err := s.Send(srcID, src, accept, func(t *kvlease.Transfer) error { st = t; return nil }); err != nil {
		t.Fatal(err)
	}
	if err := r.Receive(dstID, dst, nil, func(t *kvlease.Transfer) error { rt = t; return nil }); err != nil {
		t.Fatal(err)
	}
	for _, tr := range []*kvlease.Transfer{st, rt} {
		select {
		case <-tr.Done():
		case <-time.After(20 * time.Second):
			t.Fatal("transfer never resolved")
		}
	}
	return st.Err(), rt.Err()
}

// TestRunsDeliver: every pairing of the sender's and the receiver's
// layouts (scattered, contiguous, mixed), keyed and unkeyed, small and
// large enough to check off the socket's goroutine, delivers the bytes
// intact.
func TestRunsDeliver(t *testing.T) {
	kinds := []string{"scattered", "contiguous", "mixed"}
	for _, keyed := range []bool{false, true} {
		for _, size := range []struct{ n, bb int }{{37, 4096}, {300, 4096}} {
			for _, sk := range kinds {
				for _, dk := range kinds {
					name := fmt.Sprintf("keyed=%v/%dx%d/%s-to-%s", keyed, size.n, size.bb, sk, dk)
					srcID, dstID := handoff.PlaneID{Handoff: 1}, handoff.PlaneID{Handoff: 1}
					if keyed {
						srcID, dstID = secureID(t, 1)
					}
					src := layoutRegions(t, sk, size.n, size.bb, 1)
					dst := layoutRegions(t, dk, size.n, size.bb, 2)
					if se, re := transfer(t, srcID, dstID, src, dst, nil); se != nil || re != nil {
						t.Fatalf("%s: sender %v, receiver %v", name, se, re)
					}
					if !slicesEqual(src, dst) {
						t.Fatalf("%s: delivered other bytes", name)
					}
				}
			}
		}
	}
}

// TestRunCorruptByteRefused: one flipped byte inside a run (block 5 of a
// frame of 8) fails the receiver's transfer with ErrCorrupt, keyed (its
// block's tag) and unkeyed (the run's crc32c).
func TestRunCorruptByteRefused(t *testing.T) {
	const n, bb = 8, 4096
	for _, keyed := range []bool{false, true} {
		srcID, dstID := handoff.PlaneID{Handoff: 1}, handoff.PlaneID{Handoff: 1}
		want := "blocks 0 to 7 of 8 (one frame): crc32c"
		if keyed {
			srcID, dstID = secureID(t, 1)
			want = "block 5 of 8: its tag does not verify"
		}
		at := helloLength + 4 + 4 + frameHeader + 5*bb + 100
		wrap := func(c net.Conn) net.Conn { return &flipConn{Conn: c, at: at} }
		src := layoutRegions(t, "contiguous", n, bb, 1)
		if got := frames(nil, src); !slices.Equal(got, []int{n}) {
			t.Fatalf("frames %v, want one run", got)
		}
		_, re := transfer(t, srcID, dstID, src, layoutRegions(t, "scattered", n, bb, 2), wrap)
		if !errors.Is(re, ErrCorrupt) || !strings.Contains(re.Error(), want) {
			t.Fatalf("keyed=%v: receiver %v, want %q", keyed, re, want)
		}
	}
}

// spliceConn holds back the data stream until it is total bytes long,
// then swaps the bytes at a and b (n each) and sends it all.
type spliceConn struct {
	net.Conn
	mu          sync.Mutex
	buf         []byte
	total, a, b int
	n           int
}

func (c *spliceConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.buf = append(c.buf, p...)
	if len(c.buf) == c.total {
		x := bytes.Clone(c.buf[c.a : c.a+c.n])
		copy(c.buf[c.a:], c.buf[c.b:c.b+c.n])
		copy(c.buf[c.b:], x)
		if _, err := c.Conn.Write(c.buf); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// TestRunSpliceRefused: two runs of 4 blocks; block 1 (first run) and
// block 6 (second run) swapped on the wire, each with its frame's checks
// left as they were. Keyed, block 1's tag (bound to index 1) refuses
// block 6's bytes; unkeyed, the first run's crc32c does. The receiver
// fails with ErrCorrupt and never reports success.
func TestRunSpliceRefused(t *testing.T) {
	const n, bb = 8, 4096
	for _, keyed := range []bool{false, true} {
		srcID, dstID := handoff.PlaneID{Handoff: 1}, handoff.PlaneID{Handoff: 1}
		check, want := crcLength, "blocks 0 to 3 of 8 (one frame)"
		if keyed {
			srcID, dstID = secureID(t, 1)
			check, want = 4*tagLength, "block 1 of 8: its tag does not verify"
		}
		mem, err := kvlease.NewHostMemory(16, bb)
		if err != nil {
			t.Fatal(err)
		}
		var src [][]byte
		for _, id := range []kvlease.BlockID{0, 1, 2, 3, 8, 9, 10, 11} {
			r := mem.Region(id)
			for j := range r {
				r[j] = byte(int(id)*31 + j)
			}
			src = append(src, r)
		}
		if got := frames(nil, src); !slices.Equal(got, []int{4, 4}) {
			t.Fatalf("frames %v, want two runs of 4", got)
		}
		frame := frameHeader + 4*bb + check
		start := helloLength + 4 + 2*4
		sc := &spliceConn{total: start + 2*frame, n: bb,
			a: start + frameHeader + 1*bb, b: start + frame + frameHeader + 2*bb}
		wrap := func(c net.Conn) net.Conn { sc.Conn = c; return sc }
		_, re := transfer(t, srcID, dstID, src, layoutRegions(t, "contiguous", n, bb, 2), wrap)
		if !errors.Is(re, ErrCorrupt) || !strings.Contains(re.Error(), want) {
			t.Fatalf("keyed=%v: receiver %v, want %q", keyed, re, want)
		}
	}
}

// FuzzParseLayout: a frame layout either parses into frames of 1 to
// runCap blocks that add up to the handoff's blocks, or is refused with
// ErrCorrupt; never a panic.
func FuzzParseLayout(f *testing.F) {
	f.Add(appendLayout(nil, []int{4, 4})[4:], 8, 4096)
	f.Add(appendLayout(nil, []int{1, 0})[4:], 1, 4096)
	f.Add([]byte{1, 2, 3}, 3, 64)
	f.Fuzz(func(t *testing.T, raw []byte, blocks, bb int) {
		if blocks < 0 || blocks > 1<<20 {
			return
		}
		fr, err := parseLayout(raw, blocks, bb)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		total := 0
		for _, n := range fr {
			if n < 1 || n > runCap(bb) {
				t.Fatalf("frame of %d blocks accepted (cap %d)", n, runCap(bb))
			}
			total += n
		}
		if total != blocks || !bytes.Equal(appendLayout(nil, fr)[4:], raw) {
			t.Fatalf("layout %x for %d blocks parsed as %v", raw, blocks, fr)
		}
	})
}

// TestReadLayoutRefusesBadCounts: a layout whose frame count is zero or
// more than the blocks is refused before its body is read or allocated.
func TestReadLayoutRefusesBadCounts(t *testing.T) {
	for _, nf := range []uint32{0, 9, 1 << 31} {
		b := binary.LittleEndian.AppendUint32(nil, nf)
		if _, err := readLayout(bytes.NewReader(b), 8, 4096); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%d frames for 8 blocks: %v", nf, err)
		}
	}
}
