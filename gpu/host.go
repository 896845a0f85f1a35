package gpu

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// The CPU fallback: device memory is host memory behind an address space
// of its own, streams are worker goroutines, fences are channels. It keeps
// the property that matters to callers: a copy is finished only when its
// fence says so, later than Start returned.

const (
	// hostAddrBase is where the fallback's device address space starts;
	// arenas are placed hostAddrStride-aligned with a gap between them, so
	// an address one past an arena is in no arena.
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
}

func newHostBackend(cfg hostConfig) *hostBackend {
	b := &hostBackend{cfg: cfg, next: hostAddrBase}
	b.ctr.kernelOn.Store(true)
	return b
}

func (b *hostBackend) counters() *counters      { return &b.ctr }
func (b *hostBackend) pathState() (bool, error) { return false, nil }

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

func (b *hostBackend) allocDevice(n int) (uint64, []byte, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if int64(n) > b.cfg.capacity-b.used {
		return 0, nil, newDriverError("cuMemAlloc", ErrorOutOfMemory)
	}
	b.used += int64(n)
	addr := b.next
	b.next += (uint64(n)+hostAddrStride-1)/hostAddrStride*hostAddrStride + hostAddrStride
	return addr, alignedBytes(n), nil
}

func (b *hostBackend) freeDevice(_ uint64, n int) error {
	b.mu.Lock()
	b.used -= int64(n)
	b.mu.Unlock()
	return nil
}

func (b *hostBackend) allocPinned(n int) ([]byte, error) { return alignedBytes(n), nil }
func (b *hostBackend) freePinned([]byte) error           { return nil }

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
}

// hostJob is one submission and its fence.
type hostJob struct {
	ops      []copyOp
	descs    []gatherDesc // the gather kernel's table, for scattered device-to-device copies
	timed    bool
	canceled *atomic.Bool
	done     chan struct{} // closed when the worker is finished with ops

	// Written by the worker before done is closed.
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
		close(j.done)
	}
}

func (s *hostStream) exec(j *hostJob) {
	if f := s.b.fault.Load(); f != nil {
		j.failure = f
		return
	}
	if j.descs != nil {
		s.gather(j)
		return
	}
	for i, op := range j.ops {
		if j.canceled.Load() {
			j.skipped = len(j.ops) - i
			return
		}
		copy(op.dst.host[op.dstOff:op.dstOff+op.n], op.src.host[op.srcOff:op.srcOff+op.n])
	}
}

// gather runs the kernel's table as the PTX does, one descriptor per
// thread block, by device address: it checks the descriptors, not the ops
// they came from. Like a launched kernel, it cannot be canceled part way.
func (s *hostStream) gather(j *hostJob) {
	if j.canceled.Load() {
		j.skipped = len(j.ops)
		return
	}
	for _, d := range j.descs {
		src, dst := hostBytes(j.ops, d.src, d.n, true), hostBytes(j.ops, d.dst, d.n, false)
		if src == nil || dst == nil || d.n%16 != 0 || d.src%16 != 0 || d.dst%16 != 0 {
			// A real kernel would fault: the context is lost.
			j.failure = newDriverError("cuEventSynchronize", ErrorIllegalAddress)
			return
		}
		copy(dst, src)
	}
}

// hostBytes maps [addr, addr+n) of the fallback's device space to the
// memory of the arena among ops' sources (or destinations) that holds it.
func hostBytes(ops []copyOp, addr, n uint64, src bool) []byte {
	for _, op := range ops {
		a := op.dst
		if src {
			a = op.src
		}
		if a.contains(addr, int(n)) {
			off := addr - a.addr
			return a.host[off : off+n]
		}
	}
	return nil
}

func (s *hostStream) submit(ops []copyOp, kind copyKind, canceled *atomic.Bool) (fence, error, error) {
	if f := s.b.fault.Load(); f != nil {
		return nil, nil, f
	}
	j := &hostJob{ops: ops, canceled: canceled, done: make(chan struct{}), timed: s.b.ctr.timing.Load()}
	path := pathLoop
	if kind == deviceToDevice && len(ops) >= gatherMinOps && s.b.ctr.kernelOn.Load() {
		j.descs = make([]gatherDesc, gatherDescCount(ops))
		fillGatherDescs(j.descs, ops)
		path = pathKernel
	}
	s.b.ctr.count(path, len(ops))
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
		return fmt.Errorf("gpu: %d of %d copies skipped: %w", j.skipped, len(j.ops), ErrCanceled), nil
	}
	return nil, nil
}

func (s *hostStream) recycle(fence) {}

func (s *hostStream) destroy() error {
	close(s.jobs)
	<-s.done
	return nil
}
