// Package baseline holds the allocators kvlease is measured against: what
// a serving engine writes by hand when it has no ownership layer. Each
// hands out block ids from a fixed range [0, n) and none of them knows
// about transfers, prefix caching, generations or quarantine, so each is
// a lower bound on what a block allocator can cost.
//
//   - BareList: a mutex-guarded stack of free ids (pop n ids, push n ids).
//     The reference every kvlease benchmark divides by ("x-bare").
//   - ChanPool: a buffered channel of free ids, all-or-nothing by giving
//     back a short take.
//   - MapPool: a request-keyed map of block tables and a block-keyed map
//     of owners, the shape of many hand-written schedulers.
//   - SlotList: BareList plus the least per-block state that rule 5 of
//     kvlease's design needs (a generation per slot, bumped on every
//     reuse, and checked on return): the floor for any allocator that
//     hands out BlockRefs rather than bare ids ("x-slots").
//
// All methods are safe for concurrent use.
package baseline

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/kvlease/kvlease"
)

// BareList is a mutex-guarded stack of free block ids: the least an
// allocator can do. Pop and Push allocate nothing. PopWait adds a FIFO
// queue of waiters (one channel per waiter that actually waits), the
// least a fair waiting allocator can do.
type BareList struct {
	mu      sync.Mutex
	free    []kvlease.BlockID
	n       int
	waiters []*bareWaiter // FIFO; waiters[whead:] are queued
	whead   int
}

type bareWaiter struct {
	n     int
	dst   []kvlease.BlockID
	ready chan struct{}
	done  bool
}

// NewBareList returns a list holding ids 0..n-1, lowest on top.
func NewBareList(n int) *BareList {
	b := &BareList{free: make([]kvlease.BlockID, n), n: n}
	for i := range b.free {
		b.free[i] = kvlease.BlockID(n - 1 - i)
	}
	return b
}

// Capacity returns the number of ids the list owns.
func (b *BareList) Capacity() int { return b.n }

// Free returns the number of ids on the list now.
func (b *BareList) Free() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.free)
}

// Pop appends n ids to dst, all or nothing: ok is false (and dst is
// returned unchanged) when fewer than n are free or a PopWait caller is
// queued.
func (b *BareList) Pop(dst []kvlease.BlockID, n int) ([]kvlease.BlockID, bool) {
	b.mu.Lock()
	if len(b.free) < n || b.whead < len(b.waiters) {
		b.mu.Unlock()
		return dst, false
	}
	top := len(b.free) - n
	dst = append(dst, b.free[top:]...)
	b.free = b.free[:top]
	b.mu.Unlock()
	return dst, true
}

// Push returns ids to the list and serves queued waiters in order.
func (b *BareList) Push(ids []kvlease.BlockID) {
	b.mu.Lock()
	b.free = append(b.free, ids...)
	b.serve()
	b.mu.Unlock()
}

// PopWait is Pop that waits, first in first out, until n ids are free or
// ctx ends (then it returns ctx's error and holds nothing). n must be in
// 1..Capacity().
func (b *BareList) PopWait(ctx context.Context, dst []kvlease.BlockID, n int) ([]kvlease.BlockID, error) {
	if n <= 0 || n > b.n {
		return dst, fmt.Errorf("baseline: pop %d of %d ids: %w", n, b.n, kvlease.ErrInvalidArgument)
	}
	b.mu.Lock()
	if b.whead == len(b.waiters) && len(b.free) >= n {
		top := len(b.free) - n
		dst = append(dst, b.free[top:]...)
		b.free = b.free[:top]
		b.mu.Unlock()
		return dst, nil
	}
	w := &bareWaiter{n: n, dst: dst, ready: make(chan struct{})}
	b.waiters = append(b.waiters, w)
	b.mu.Unlock()
	select {
	case <-w.ready:
		return w.dst, nil
	case <-ctx.Done():
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if w.done {
		return w.dst, nil
	}
	for i := b.whead; i < len(b.waiters); i++ {
		if b.waiters[i] == w {
			b.waiters = append(b.waiters[:i], b.waiters[i+1:]...)
			break
		}
	}
	b.serve()
	return dst, ctx.Err()
}

// serve hands ids to queued waiters in order. Called with b.mu held.
func (b *BareList) serve() {
	for b.whead < len(b.waiters) {
		w := b.waiters[b.whead]
		if len(b.free) < w.n {
			break
		}
		top := len(b.free) - w.n
		w.dst = append(w.dst, b.free[top:]...)
		b.free = b.free[:top]
		w.done = true
		close(w.ready)
		b.waiters[b.whead] = nil
		b.whead++
	}
	if b.whead == len(b.waiters) {
		b.waiters, b.whead = b.waiters[:0], 0
	}
}

// ChanPool is a buffered channel of free block ids, the pool many Go
// programs write first. Pop takes n ids without blocking and gives a
// short take back, so it is all or nothing but not fair.
type ChanPool struct {
	ch chan kvlease.BlockID
	n  int
}

// NewChanPool returns a pool holding ids 0..n-1.
func NewChanPool(n int) *ChanPool {
	p := &ChanPool{ch: make(chan kvlease.BlockID, n), n: n}
	for i := range n {
		p.ch <- kvlease.BlockID(i)
	}
	return p
}

// Capacity returns the number of ids the pool owns.
func (p *ChanPool) Capacity() int { return p.n }

// Free returns the number of ids in the channel now.
func (p *ChanPool) Free() int { return len(p.ch) }

// Pop appends n ids to dst, all or nothing (ok false: dst unchanged).
func (p *ChanPool) Pop(dst []kvlease.BlockID, n int) ([]kvlease.BlockID, bool) {
	start := len(dst)
	for range n {
		select {
		case id := <-p.ch:
			dst = append(dst, id)
		default:
			p.Push(dst[start:])
			return dst[:start], false
		}
	}
	return dst, true
}

// Push returns ids to the pool.
func (p *ChanPool) Push(ids []kvlease.BlockID) {
	for _, id := range ids {
		p.ch <- id
	}
}

// MapPool is the allocator of a hand-written scheduler: a free list, a
// map from request id to its block table and a map from block to owning
// request (kept for ownership checks and debugging). It allocates each
// block table on Acquire, as such schedulers do.
type MapPool struct {
	mu     sync.Mutex
	free   []kvlease.BlockID
	n      int
	tables map[string][]kvlease.BlockID
	owner  map[kvlease.BlockID]string
}

// NewMapPool returns a pool of ids 0..n-1.
func NewMapPool(n int) *MapPool {
	p := &MapPool{free: make([]kvlease.BlockID, n), n: n,
		tables: make(map[string][]kvlease.BlockID), owner: make(map[kvlease.BlockID]string)}
	for i := range p.free {
		p.free[i] = kvlease.BlockID(n - 1 - i)
	}
	return p
}

// Capacity returns the number of ids the pool owns.
func (p *MapPool) Capacity() int { return p.n }

// Free returns the number of free ids.
func (p *MapPool) Free() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.free)
}

// Acquire gives request req a table of n blocks, all or nothing. It fails
// with ErrExhausted when fewer are free and ErrInvalidArgument when req
// already holds a table.
func (p *MapPool) Acquire(req string, n int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.tables[req]; ok {
		return fmt.Errorf("baseline: request %q already holds blocks: %w", req, kvlease.ErrInvalidArgument)
	}
	if len(p.free) < n {
		return fmt.Errorf("baseline: acquire %d blocks for %q: %d free: %w", n, req, len(p.free), kvlease.ErrExhausted)
	}
	t := make([]kvlease.BlockID, 0, n)
	p.tables[req] = p.take(req, t, n)
	return nil
}

// Extend appends n blocks to req's table, all or nothing.
func (p *MapPool) Extend(req string, n int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	t, ok := p.tables[req]
	if !ok {
		return fmt.Errorf("baseline: extend %q: no table: %w", req, kvlease.ErrLeaseClosed)
	}
	if len(p.free) < n {
		return fmt.Errorf("baseline: extend %q by %d: %d free: %w", req, n, len(p.free), kvlease.ErrExhausted)
	}
	p.tables[req] = p.take(req, t, n)
	return nil
}

func (p *MapPool) take(req string, t []kvlease.BlockID, n int) []kvlease.BlockID {
	top := len(p.free) - n
	for _, id := range p.free[top:] {
		p.owner[id] = req
		t = append(t, id)
	}
	p.free = p.free[:top]
	return t
}

// Table returns req's block table (nil if it holds none). The caller must
// not modify it.
func (p *MapPool) Table(req string) []kvlease.BlockID {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.tables[req]
}

// Release returns req's blocks; a request holding nothing is a no-op.
func (p *MapPool) Release(req string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	t, ok := p.tables[req]
	if !ok {
		return
	}
	delete(p.tables, req)
	for i := len(t) - 1; i >= 0; i-- {
		delete(p.owner, t[i])
		p.free = append(p.free, t[i])
	}
}

// SlotList is BareList plus a slot table: the least an allocator must do
// to detect stale references (rule 5 of kvlease's design), made as lean as
// it honestly can be, so that the ratio of kvlease to it ("x-slots")
// measures everything else kvlease does per block and per lease.
//
// Each slot is one packed word: its generation in the high 32 bits and an
// in-use bit at the bottom. Pop bumps the generation and sets the bit (one
// load and one store per block); Push checks the whole word against the
// ref in one compare and clears the bit. No defer, no allocation when dst
// has room. Generation 0 is never handed out, as in kvlease: a generation
// that wraps skips it.
type SlotList struct {
	mu    sync.Mutex
	free  []kvlease.BlockID
	slots []uint64 // gen<<32 | in-use
}

// inUse is a slot word's in-use bit.
const inUse = 1

// NewSlotList returns a list of n free slots, lowest id on top.
func NewSlotList(n int) *SlotList {
	s := &SlotList{free: make([]kvlease.BlockID, n), slots: make([]uint64, n)}
	for i := range s.free {
		s.free[i] = kvlease.BlockID(n - 1 - i)
	}
	return s
}

// Free returns the number of free slots.
func (s *SlotList) Free() int {
	s.mu.Lock()
	n := len(s.free)
	s.mu.Unlock()
	return n
}

// Pop appends refs to n fresh slots to dst, all or nothing.
func (s *SlotList) Pop(dst []kvlease.BlockRef, n int) ([]kvlease.BlockRef, bool) {
	s.mu.Lock()
	top := len(s.free) - n
	if top < 0 {
		s.mu.Unlock()
		return dst, false
	}
	dst = slices.Grow(dst, n)
	out := dst[len(dst) : len(dst)+n]
	slots := s.slots
	for i, id := range s.free[top:] {
		gen := uint32(slots[id]>>32) + 1
		if gen == 0 {
			gen = 1
		}
		slots[id] = uint64(gen)<<32 | inUse
		out[i] = kvlease.BlockRef{ID: id, Gen: gen}
	}
	s.free = s.free[:top]
	s.mu.Unlock()
	return dst[:len(dst)+n], true
}

// Push returns the slots of refs, last first. It stops at the first ref
// that is stale (wrong generation) or not in use and reports false; the
// refs before it are returned.
func (s *SlotList) Push(refs []kvlease.BlockRef) bool {
	s.mu.Lock()
	slots, free := s.slots, s.free
	ok := true
	for i := len(refs) - 1; i >= 0; i-- {
		r := refs[i]
		want := uint64(r.Gen)<<32 | inUse
		if slots[r.ID] != want {
			ok = false
			break
		}
		slots[r.ID] = want &^ inUse
		free = append(free, r.ID)
	}
	s.free = free
	s.mu.Unlock()
	return ok
}
