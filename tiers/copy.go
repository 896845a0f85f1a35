package tiers

import (
	"fmt"
	"go.uber.org/atomic"
	"unsafe"

	"github.com/kvlease/kvlease"
)

// MemCopy is a kvlease.Transport between two Go-memory tiers (a CPU
// "device" pool over kvlease.HostMemory and a host pool): each Start
// copies its pairs on a goroutine of its own and resolves the transfer
// when that goroutine is done. Cancel skips the pairs not yet copied.
// With a GPU, use the gpu package's CopyEngine transports instead.
//
// The zero MemCopy copies block by block. One made by NewMemCopy knows
// the memories it copies between and copies each run at once: pairs
// whose sources and destinations both continue the previous pair's in
// one of those memories (consecutive block ids on both sides, which the
// pools' contiguous allocation makes common) become one copy.
type MemCopy struct {
	arenas [][]byte // each memory's whole span
}

var _ kvlease.Transport[[]byte, []byte] = MemCopy{}

// NewMemCopy returns a MemCopy that merges runs of blocks within mems.
func NewMemCopy(mems ...*kvlease.HostMemory) MemCopy {
	m := MemCopy{}
	for _, mem := range mems {
		m.arenas = append(m.arenas, mem.Span(kvlease.Run{Start: 0, Len: mem.Blocks()}))
	}
	return m
}

// Start implements kvlease.Transport.
func (m MemCopy) Start(pairs []kvlease.CopyPair[[]byte, []byte], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	if len(pairs) == 0 || attach == nil {
		return nil, fmt.Errorf("tiers: copy of %d pairs: %w", len(pairs), kvlease.ErrInvalidArgument)
	}
	for _, p := range pairs {
		if len(p.Src) != len(p.Dst) {
			return nil, fmt.Errorf("tiers: copy of %d bytes into %d: %w", len(p.Src), len(p.Dst), kvlease.ErrInvalidArgument)
		}
	}
	var canceled atomic.Bool
	t := kvlease.NewTransfer(func() { canceled.Store(true) })
	if err := attach(t); err != nil {
		t.Resolve(err)
		return t, err
	}
	go func() {
		done := 0
		var err error
		m.each(pairs, func(src, dst []byte, blocks int) bool {
			if canceled.Load() {
				err = fmt.Errorf("tiers: copy canceled after %d of %d blocks: %w", done, len(pairs), kvlease.ErrCanceled)
				return false
			}
			copy(dst, src)
			done += blocks
			return true
		})
		t.Resolve(err)
	}()
	return t, nil
}

// each calls fn with the copies pairs make, in order, until fn returns
// false: one per pair, except that the pairs whose sources and
// destinations both continue the previous pair's, inside one of m's
// memories, join its copy (blocks says how many pairs a copy carries).
// It allocates nothing.
func (m MemCopy) each(pairs []kvlease.CopyPair[[]byte, []byte], fn func(src, dst []byte, blocks int) bool) {
	for i := 0; i < len(pairs); {
		p := pairs[i]
		src, dst := p.Src, p.Dst
		j := i + 1
		if sa, soff, ok := m.locate(src); ok {
			if da, doff, ok := m.locate(dst); ok {
				send, dend := soff+len(src), doff+len(dst)
				for ; j < len(pairs); j++ {
					q := pairs[j]
					n := len(q.Src)
					if n == 0 || send+n > len(sa) || dend+n > len(da) ||
						unsafe.SliceData(q.Src) != &sa[send] || unsafe.SliceData(q.Dst) != &da[dend] {
						break
					}
					send += n
					dend += n
				}
				src, dst = sa[soff:send:send], da[doff:dend:dend]
			}
		}
		if !fn(src, dst, j-i) {
			return
		}
		i = j
	}
}

// locate returns the memory of m that b lies in and b's offset there.
func (m MemCopy) locate(b []byte) (arena []byte, off int, ok bool) {
	if len(b) == 0 {
		return nil, 0, false
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	for _, ar := range m.arenas {
		base := uintptr(unsafe.Pointer(unsafe.SliceData(ar)))
		if p >= base && p+uintptr(len(b)) <= base+uintptr(len(ar)) {
			return ar, int(p - base), true
		}
	}
	return nil, 0, false
}

// copies is how many copies Start makes of pairs: the descriptors a
// transfer of them posts.
func (m MemCopy) copies(pairs []kvlease.CopyPair[[]byte, []byte]) int {
	n := 0
	m.each(pairs, func([]byte, []byte, int) bool { n++; return true })
	return n
}
