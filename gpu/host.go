package gpu

import (
	"fmt"
	"sort"
	"sync"
	"time"
	"unsafe"

	"github.com/kvlease/kvlease"
	"go.uber.org/atomic"
)

// The CPU fallback: device memory is host memory behind an address space
// of its own, streams are worker goroutines, fences are jobs the worker
// signals. It keeps the property that matters to callers: a copy is
// finished only when its fence says so, later than Start returned. Pinned
// memory is mapped into that address space too, and the copy kernel's
// launches run on the worker as the PTX would: the table is read by device
// address when the worker gets to it (so a ring slot reused too early
// shows), and every address in it must lie in a live allocation, or the
// "device" faults with a sticky error.

const (
	// hostAddrBase is where the fallback's device address space starts;
	// allocations are placed hostAddrStride-aligned with a gap between
	// them, so an address one past an allocation is in none.
	hostAddrBase   = 1 << 44
	hostAddrStride = 2 << 20
	// hostQueueDepth bounds a fallback stream's queue; Start blocks when it
	// is full, as a CUDA stream's launch queue does.
	hostQueueDepth = 1024
)

type hostConfig struct {
	capacity int64
	// gate, when non-nil, makes every stream worker take a token before
	// each job: tests hold copies back to observe pending transfers.
	gate chan struct{}
}

type hostBackend struct {
	cfg   hostConfig
	fault atomic.Pointer[DriverError] // a simulated sticky error: every later job fails
	ctr   counters

	mu   sync.Mutex
	used int64
	next uint64
	// maps is the device address space: every live allocation (device
	// memory and mapped pinned memory) by address, for the kernel.
	maps []hostMapping
}

// hostMapping is one allocation of the fallback's device address space.
type hostMapping struct {
	addr uint64
	mem  []byte
}

func newHostBackend(cfg hostConfig) *hostBackend {
	return &hostBackend{cfg: cfg, next: hostAddrBase}
}

func (b *hostBackend) counters() *counters      { return &b.ctr }
func (b *hostBackend) pathState() (bool, error) { return false, nil }
func (b *hostBackend) loadKernel() error        { return nil }
func (b *hostBackend) multiprocessors() int     { return 0 }

func (b *hostBackend) name() string       { return "CPU fallback" }
func (b *hostBackend) driverVersion() int { return 0 }

func (b *hostBackend) totalMemory() (int64, error) { return b.cfg.capacity, nil }

func (b *hostBackend) freeMemory() (int64, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.cfg.capacity - b.used, nil
}

// alignedBytes returns n zeroed bytes starting at an Alignment boundary.
func alignedBytes(n int) []byte {
	raw := make([]byte, n+Alignment)
	off := (Alignment - int(addrOf(raw)%Alignment)) % Alignment
	return raw[off : off+n : off+n]
}

// mapLocked gives mem an address range of the device address space.
func (b *hostBackend) mapLocked(mem []byte) uint64 {
	addr := b.next
	b.next += (uint64(len(mem))+hostAddrStride-1)/hostAddrStride*hostAddrStride + hostAddrStride
	b.maps = append(b.maps, hostMapping{addr, mem}) // addresses only grow: the list stays sorted
	return addr
}

func (b *hostBackend) unmapLocked(addr uint64) {
	i := sort.Search(len(b.maps), func(i int) bool { return b.maps[i].addr >= addr })
	if i < len(b.maps) && b.maps[i].addr == addr {
		b.maps = append(b.maps[:i], b.maps[i+1:]...)
	}
}

// lookup returns the n bytes at device address addr, or nil when they are
// not inside one live allocation.
func (b *hostBackend) lookup(addr, n uint64) []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	i := sort.Search(len(b.maps), func(i int) bool { return b.maps[i].addr > addr })
	if i == 0 {
		return nil
	}
	m := b.maps[i-1]
	off := addr - m.addr
	if off > uint64(len(m.mem)) || n > uint64(len(m.mem))-off {
		return nil
	}
	return m.mem[off : off+n]
}

func (b *hostBackend) allocDevice(n int) (uint64, []byte, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if int64(n) > b.cfg.capacity-b.used {
		return 0, nil, newDriverError("cuMemAlloc", ErrorOutOfMemory)
	}
	b.used += int64(n)
	mem := alignedBytes(n)
	return b.mapLocked(mem), mem, nil
}

func (b *hostBackend) freeDevice(addr uint64, n int) error {
	b.mu.Lock()
	b.used -= int64(n)
	b.unmapLocked(addr)
	b.mu.Unlock()
	return nil
}

func (b *hostBackend) allocPinned(n int) ([]byte, uint64, error) {
	mem := alignedBytes(n)
	b.mu.Lock()
	defer b.mu.Unlock()
	return mem, b.mapLocked(mem), nil
}

func (b *hostBackend) freePinned(mem []byte) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, m := range b.maps {
		if unsafe.SliceData(m.mem) == unsafe.SliceData(mem) {
			b.maps = append(b.maps[:i], b.maps[i+1:]...)
			break
		}
	}
	return nil
}

func (b *hostBackend) readDevice(dst []byte, a *arena, off int) error {
	copy(dst, a.host[off:off+len(dst)])
	return nil
}

func (b *hostBackend) writeDevice(a *arena, off int, src []byte) error {
	copy(a.host[off:off+len(src)], src)
	return nil
}

func (b *hostBackend) close() error { return nil }

// injectFault makes the device fail as after a sticky error: every job not
// yet finished, and every later one, fails with code.
func (b *hostBackend) injectFault(code Result) {
	b.fault.Store(newDriverError("cuEventSynchronize", code))
}

func (b *hostBackend) newStream() (stream, error) {
	s := &hostStream{b: b, jobs: make(chan *hostJob, hostQueueDepth), done: make(chan struct{})}
	go s.run()
	return s, nil
}

// hostStream runs jobs in order on one worker goroutine.
type hostStream struct {
	b    *hostBackend
	jobs chan *hostJob
	done chan struct{}

	mu   sync.Mutex
	free []*hostJob // recycled fences
}

// hostJob is one submission and its fence. Recycled: the worker signals
// done with a token, not by closing it.
type hostJob struct {
	sub   submission
	timed bool
	done  chan struct{} // capacity 1: the worker's token once finished with sub

	// Written by the worker before it signals done.
	skipped int
	failure error
}

func (s *hostStream) run() {
	defer close(s.done)
	for j := range s.jobs {
		if s.b.cfg.gate != nil {
			<-s.b.cfg.gate
		}
		var t0 time.Time
		if j.timed {
			t0 = time.Now()
		}
		s.exec(j)
		if j.timed {
			s.b.ctr.addGPUTime(time.Since(t0))
		}
		j.done <- struct{}{}
	}
}

func (s *hostStream) exec(j *hostJob) {
	if f := s.b.fault.Load(); f != nil {
		j.failure = f
		return
	}
	if j.sub.kernel {
		s.kernel(j)
		return
	}
	for i, op := range j.sub.ops {
		if i%64 == 0 && j.sub.t.CancelRequested() {
			j.skipped = len(j.sub.ops) - i
			return
		}
		copy(op.dst.host[op.dstOff:op.dstOff+op.n], op.src.host[op.srcOff:op.srcOff+op.n])
	}
}

// kernel runs a launch as the PTX does: it reads the table by device
// address now (not when it was written), then copies each item by device
// address. Like a launched kernel it cannot be canceled part way, and an
// address outside every live allocation, or a misaligned one, is a fault
// that loses the context.
func (s *hostStream) kernel(j *hostJob) {
	if j.sub.t.CancelRequested() {
		j.skipped = len(j.sub.ops)
		return
	}
	l := j.sub.launch
	n := uint64(l.ncta) + uint64(l.nwarp)
	raw := s.b.lookup(l.table, n*descBytes)
	if raw == nil || l.table%16 != 0 || l.grid == 0 {
		s.fault(j, ErrorIllegalAddress)
		return
	}
	table := unsafe.Slice((*kernelDesc)(unsafe.Pointer(unsafe.SliceData(raw))), n)
	for i, d := range table {
		if d.n == 0 || d.n%16 != 0 || d.src%16 != 0 || d.dst%16 != 0 ||
			(uint64(i) < uint64(l.ncta) && d.n > kernelChunk) || (uint64(i) >= uint64(l.ncta) && d.n > warpMaxBytes) {
			s.fault(j, ErrorMisalignedAddress)
			return
		}
		src, dst := s.b.lookup(d.src, d.n), s.b.lookup(d.dst, d.n)
		if src == nil || dst == nil {
			s.fault(j, ErrorIllegalAddress)
			return
		}
		copy(dst, src)
	}
}

// fault loses the fallback's context, as a faulting kernel does.
func (s *hostStream) fault(j *hostJob, code Result) {
	s.b.injectFault(code)
	j.failure = s.b.fault.Load()
}

func (s *hostStream) submit(sub *submission) (fence, error, error) {
	if f := s.b.fault.Load(); f != nil {
		return nil, nil, f
	}
	s.mu.Lock()
	var j *hostJob
	if n := len(s.free); n > 0 {
		j = s.free[n-1]
		s.free = s.free[:n-1]
	}
	s.mu.Unlock()
	if j == nil {
		j = &hostJob{done: make(chan struct{}, 1)}
	}
	j.sub, j.timed, j.skipped, j.failure = *sub, s.b.ctr.timing.Load(), 0, nil
	path := pathLoop
	if sub.kernel {
		path = pathKernel
		sub.ctr.kernelCTAs.Add(int64(sub.launch.grid))
	}
	sub.ctr.count(path, len(sub.ops))
	s.jobs <- j
	return j, nil, nil
}

func (s *hostStream) wait(f fence) (outcome, failure error) {
	j := f.(*hostJob)
	<-j.done
	switch {
	case j.failure != nil:
		return nil, j.failure
	case j.skipped > 0:
		return fmt.Errorf("gpu: %d of %d copies skipped: %w", j.skipped, len(j.sub.ops), kvlease.ErrCanceled), nil
	}
	return nil, nil
}

func (s *hostStream) recycle(f fence) {
	j := f.(*hostJob)
	j.sub = submission{}
	s.mu.Lock()
	if len(s.free) < maxFreeJobs {
		s.free = append(s.free, j)
	}
	s.mu.Unlock()
}

func (s *hostStream) destroy() error {
	close(s.jobs)
	<-s.done
	return nil
}
