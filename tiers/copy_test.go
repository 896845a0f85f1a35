package tiers

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
)

// runPairs returns the pairs copying src blocks srcIDs[i] to dst blocks
// dstIDs[i].
func runPairs(src, dst *kvlease.HostMemory, srcIDs, dstIDs []kvlease.BlockID) []kvlease.CopyPair[[]byte, []byte] {
	pairs := make([]kvlease.CopyPair[[]byte, []byte], len(srcIDs))
	for i := range srcIDs {
		pairs[i] = kvlease.CopyPair[[]byte, []byte]{Src: src.Region(srcIDs[i]), Dst: dst.Region(dstIDs[i])}
	}
	return pairs
}

func ids(start, n int) []kvlease.BlockID {
	s := make([]kvlease.BlockID, n)
	for i := range s {
		s[i] = kvlease.BlockID(start + i)
	}
	return s
}

// waitCopy starts pairs on m and waits for the transfer.
func waitCopy(t testing.TB, m MemCopy, pairs []kvlease.CopyPair[[]byte, []byte]) {
	t.Helper()
	tr, err := m.Start(pairs, func(*kvlease.Transfer) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-tr.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("copy did not resolve")
	}
	if err := tr.Err(); err != nil {
		t.Fatal(err)
	}
}

// TestMemCopyRuns: a MemCopy made by NewMemCopy copies a run of blocks
// that is a run on both sides at once, splits where either side breaks,
// never merges outside its memories, and copies the same bytes as the
// block-by-block zero MemCopy.
func TestMemCopyRuns(t *testing.T) {
	const bb = 64
	src, _ := kvlease.NewHostMemory(32, bb)
	dst, _ := kvlease.NewHostMemory(32, bb)
	other, _ := kvlease.NewHostMemory(32, bb)
	for i := range 32 {
		r := src.Region(kvlease.BlockID(i))
		for k := range r {
			r[k] = byte(i*7 + k)
		}
	}
	m := NewMemCopy(src, dst)
	cases := []struct {
		name           string
		srcIDs, dstIDs []kvlease.BlockID
		copies         int
	}{
		{"one run", ids(0, 16), ids(8, 16), 1},
		{"src breaks", append(ids(0, 4), ids(10, 4)...), ids(0, 8), 2},
		{"dst breaks", ids(0, 8), append(ids(20, 5), ids(2, 3)...), 2},
		{"descending", []kvlease.BlockID{5, 4, 3}, []kvlease.BlockID{5, 4, 3}, 3},
		{"single", ids(31, 1), ids(0, 1), 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			clear(dst.Span(kvlease.Run{Start: 0, Len: 32}))
			pairs := runPairs(src, dst, c.srcIDs, c.dstIDs)
			if got := m.copies(pairs); got != c.copies {
				t.Fatalf("%d copies, want %d", got, c.copies)
			}
			if got := (MemCopy{}).copies(pairs); got != len(pairs) {
				t.Fatalf("zero MemCopy: %d copies, want %d", got, len(pairs))
			}
			waitCopy(t, m, pairs)
			for i := range c.srcIDs {
				if !bytes.Equal(dst.Region(c.dstIDs[i]), src.Region(c.srcIDs[i])) {
					t.Fatalf("block %d → %d: bytes differ", c.srcIDs[i], c.dstIDs[i])
				}
			}
		})
	}
	// A memory the MemCopy does not know is copied block by block.
	if got := m.copies(runPairs(src, other, ids(0, 8), ids(0, 8))); got != 8 {
		t.Fatalf("unknown destination memory: %d copies, want 8", got)
	}
	// Mismatched sizes are refused before anything is attached.
	bad := []kvlease.CopyPair[[]byte, []byte]{{Src: src.Region(0), Dst: dst.Span(kvlease.Run{Start: 0, Len: 2})}}
	if _, err := m.Start(bad, func(*kvlease.Transfer) error { return nil }); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("mismatched pair: %v", err)
	}
}

// BenchmarkHostCopyRuns copies 256 blocks of 4 KiB host to host through
// NewMemCopy's transport in the same run, three ways: scattered (no two
// blocks adjacent on the destination: a copy per block), contiguous (one
// run on both sides, merged into one copy) and the same bytes as one
// buffer (a single 1 MiB pair). It reports each one's GB/s, the
// contiguous layout's share of the one-buffer figure (goal ≥ 0.8), the
// descriptors (copies) per transfer of both layouts, and a bare 1 MiB
// copy() without a transfer for scale.
func BenchmarkHostCopyRuns(b *testing.B) {
	const blocks, bb = 256, 4096
	src, _ := kvlease.NewHostMemory(blocks, bb)
	dst, _ := kvlease.NewHostMemory(blocks, bb)
	m := NewMemCopy(src, dst)
	perm := ids(0, blocks)
	rand.New(rand.NewPCG(1, 2)).Shuffle(len(perm), func(i, j int) { perm[i], perm[j] = perm[j], perm[i] })
	contig := runPairs(src, dst, ids(0, blocks), ids(0, blocks))
	scattered := runPairs(src, dst, ids(0, blocks), perm)
	whole := []kvlease.CopyPair[[]byte, []byte]{{
		Src: src.Span(kvlease.Run{Start: 0, Len: blocks}), Dst: dst.Span(kvlease.Run{Start: 0, Len: blocks})}}
	var tScat, tCont, tOne, tBare time.Duration
	b.SetBytes(blocks * bb)
	b.ResetTimer()
	// The order rotates every iteration, so that none of the three always
	// follows the same one (the caches it leaves).
	var took [3]time.Duration
	for i := range b.N {
		for k := range 3 {
			w := (i + k) % 3
			t0 := time.Now()
			switch w {
			case 0:
				waitCopy(b, m, scattered)
			case 1:
				waitCopy(b, m, contig)
			case 2:
				waitCopy(b, m, whole)
			}
			took[w] += time.Since(t0)
		}
		t0 := time.Now()
		copy(whole[0].Dst, whole[0].Src)
		tBare += time.Since(t0)
	}
	tScat, tCont, tOne = took[0], took[1], took[2]
	gbps := func(d time.Duration) float64 { return float64(b.N) * blocks * bb / d.Seconds() / 1e9 }
	b.ReportMetric(gbps(tScat), "scattered-GB/s")
	b.ReportMetric(gbps(tCont), "contig-GB/s")
	b.ReportMetric(gbps(tOne), "onebuf-GB/s")
	b.ReportMetric(gbps(tBare), "memmove-GB/s")
	b.ReportMetric(tOne.Seconds()/tCont.Seconds(), "contig/onebuf")
	b.ReportMetric(float64(m.copies(scattered)), "descs-scattered")
	b.ReportMetric(float64(m.copies(contig)), "descs-contig")
}

// countCopy is a transport that counts the pairs it is given and the
// copies its MemCopy makes of them.
type countCopy struct {
	m             MemCopy
	pairs, copies atomic.Int64
}

func (c *countCopy) Start(pairs []kvlease.CopyPair[[]byte, []byte], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	c.pairs.Add(int64(len(pairs)))
	c.copies.Add(int64(c.m.copies(pairs)))
	return c.m.Start(pairs, attach)
}

// TestCacheCopiesRuns: a prompt's blocks offloaded to the host tier on
// eviction and onboarded back travel as one copy each way with
// NewMemCopy (the pools hand out runs; the offload lays the host blocks
// out in the device blocks' order), and arrive intact.
func TestCacheCopiesRuns(t *testing.T) {
	const bt, bb = 4, 64
	dm, _ := kvlease.NewHostMemory(8, bb)
	hm, _ := kvlease.NewHostMemory(32, bb)
	dev, _ := kvlease.NewPool[[]byte](dm, kvlease.WithBlockTokens(bt), kvlease.WithSealRecords())
	host, _ := kvlease.NewPool[[]byte](hm, kvlease.WithBlockTokens(bt), kvlease.WithSealRecords())
	off, on := &countCopy{m: NewMemCopy(dm, hm)}, &countCopy{m: NewMemCopy(hm, dm)}
	c, err := New(Config[[]byte]{Device: dev, Host: host, Offload: off, Onload: on, DeviceReserve: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	quiet := func() {
		deadline := time.Now().Add(10 * time.Second)
		for dev.Stats().Leased+dev.Stats().Draining+host.Stats().Leased+host.Stats().Draining > 0 {
			if time.Now().After(deadline) {
				t.Fatal("copies did not land")
			}
			time.Sleep(100 * time.Microsecond)
		}
	}
	serve := func(doc int32) {
		tokens := make([]int32, 4*bt)
		for i := range tokens {
			tokens[i] = doc*100 + int32(i)
		}
		hashes := kvlease.ChainHashes(7, tokens, bt)
		o, err := c.Acquire("req", hashes, len(hashes))
		if err != nil {
			t.Fatal(err)
		}
		valid, err := o.Wait(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		parent := kvlease.BlockHash(7)
		if valid > 0 {
			parent = hashes[valid-1]
		}
		for k := range hashes {
			r, err := o.Lease.ReadRegion(k)
			if err != nil {
				t.Fatal(err)
			}
			if k < valid {
				if r[0] != byte(doc) || r[1] != byte(k) {
					t.Fatalf("doc %d block %d came back as %v", doc, k, r[:2])
				}
				continue
			}
			w, err := o.Lease.Region(k)
			if err != nil {
				t.Fatal(err)
			}
			w[0], w[1] = byte(doc), byte(k)
			if parent, err = c.SealTokens(o.Lease, k, parent, tokens[bt*k:bt*k+bt]); err != nil {
				t.Fatal(err)
			}
		}
		o.Lease.Release()
		quiet()
	}
	serve(1)
	serve(2)
	serve(3) // evicts doc 1 down to the host
	serve(1) // onboards it
	if st := c.Stats().Tiers[TierHost]; st.Offloaded == 0 || st.Onboarded != 4 {
		t.Fatalf("offloaded %d onboarded %d", st.Offloaded, st.Onboarded)
	}
	t.Logf("offload: %d pairs in %d copies; onload: %d pairs in %d copies",
		off.pairs.Load(), off.copies.Load(), on.pairs.Load(), on.copies.Load())
	if on.pairs.Load() != 4 || on.copies.Load() != 1 {
		t.Fatalf("onload: %d pairs in %d copies, want 4 in 1", on.pairs.Load(), on.copies.Load())
	}
	if off.copies.Load()*4 != off.pairs.Load() {
		t.Fatalf("offload: %d pairs in %d copies, want one copy per prompt of 4", off.pairs.Load(), off.copies.Load())
	}
}
