//go:build cgo && linux

package gpu

/*
#cgo LDFLAGS: -ldl
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cudadrv.h"
#include "driver_shims.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"go.uber.org/atomic"
)

// cudaDriver is one loaded driver library with its entry points.
type cudaDriver struct {
	path     string
	api      *C.kvl_api // C memory, never freed: the library stays loaded
	resolver int        // 2: cuGetProcAddress_v2, 1: cuGetProcAddress, 0: dlsym only
	version  int
	initErr  error
}

var (
	driversMu sync.Mutex
	drivers   = map[string]*cudaDriver{}
)

// loadDriver loads the driver library at path once per process (dlopen and
// cuInit), caching the outcome of a load that found the library.
func loadDriver(path string) (*cudaDriver, error) {
	driversMu.Lock()
	defer driversMu.Unlock()
	if d, ok := drivers[path]; ok {
		return d, d.initErr
	}
	api := (*C.kvl_api)(C.calloc(1, C.sizeof_kvl_api))
	if api == nil {
		return nil, errors.New("gpu: out of C memory")
	}
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var (
		msg      [512]C.char
		handle   C.uintptr_t
		resolver C.int
	)
	switch C.kvl_load(cpath, api, &handle, &resolver, &msg[0], C.size_t(len(msg))) {
	case 0:
	case 1:
		C.free(unsafe.Pointer(api))
		return nil, fmt.Errorf("gpu: loading %s: %s: %w", path, C.GoString(&msg[0]), ErrNoDriver)
	default:
		C.free(unsafe.Pointer(api))
		return nil, fmt.Errorf("gpu: %s lacks the entry point %s (driver older than CUDA 12?): %w", path, C.GoString(&msg[0]), ErrNoDriver)
	}
	d := &cudaDriver{path: path, api: api, resolver: int(resolver)}
	var version C.int
	if r := C.kvl_init(api, &version); r != 0 {
		d.initErr = d.err("cuInit", r)
	}
	d.version = int(version)
	drivers[path] = d
	return d, d.initErr
}

// err turns a CUresult into a *DriverError named by the driver.
func (d *cudaDriver) err(op string, r C.CUresult) error {
	if r == 0 {
		return nil
	}
	e := newDriverError(op, Result(r))
	var name, str *C.char
	C.kvl_error_strings(d.api, r, &name, &str)
	if name != nil {
		e.Name = C.GoString(name)
	}
	if str != nil {
		e.Text = C.GoString(str)
	}
	return e
}

// cudaBackend is one device with its retained primary context.
type cudaBackend struct {
	drv      *cudaDriver
	dev      C.CUdevice
	ctx      C.uintptr_t
	devName  string
	total    int64
	useBatch atomic.Bool // cuMemcpyBatchAsync is present and has not failed
	ctr      counters
	sms      int  // multiprocessors, 0 when the driver cannot say
	canMap   bool // pinned memory can be mapped into the device's address space

	// The copy kernel, loaded at its first use; kernErr is set once it
	// failed to load or launch (or cannot exist), and the kernel is off for
	// good. kernFn is read without the lock once set (kernReady).
	kernMu    sync.Mutex
	kernMod   C.uintptr_t
	kernFn    C.uintptr_t
	kernErr   error
	kernReady atomic.Bool
}

func openCUDA(path string, ordinal int) (backend, error) {
	drv, err := loadDriver(path)
	if err != nil {
		return nil, err
	}
	api := drv.api
	var count C.int
	if r := C.kvl_device_count(api, &count); r != 0 {
		return nil, drv.err("cuDeviceGetCount", r)
	}
	if ordinal < 0 || ordinal >= int(count) {
		return nil, fmt.Errorf("gpu: device ordinal %d: the driver at %s sees %d devices: %w", ordinal, path, int(count), ErrNoDevice)
	}
	b := &cudaBackend{drv: drv}
	if r := C.kvl_device_get(api, &b.dev, C.int(ordinal)); r != 0 {
		return nil, drv.err("cuDeviceGet", r)
	}
	var name [256]C.char
	if r := C.kvl_device_name(api, &name[0], C.int(len(name)), b.dev); r != 0 {
		return nil, drv.err("cuDeviceGetName", r)
	}
	b.devName = C.GoString(&name[0])
	var total C.size_t
	if r := C.kvl_device_total(api, &total, b.dev); r != 0 {
		return nil, drv.err("cuDeviceTotalMem", r)
	}
	b.total = int64(total)
	if r := C.kvl_ctx_retain(api, b.dev, &b.ctx); r != 0 {
		return nil, drv.err("cuDevicePrimaryCtxRetain", r)
	}
	b.useBatch.Store(C.kvl_has_batch(api) != 0)
	if C.kvl_has_kernel(api) == 0 {
		b.kernErr = errors.New("gpu: the driver lacks cuModuleLoadData, cuModuleGetFunction, cuLaunchKernel or cuModuleUnload")
	}
	_, _, b.sms = b.deviceAttrs()
	var v C.int
	b.canMap = C.kvl_has_map(api) != 0 &&
		C.kvl_device_attr(api, b.dev, C.KVL_CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, &v) == 0 && v != 0
	if !b.canMap && b.kernErr == nil {
		// The kernel's tables live in mapped pinned memory.
		b.kernErr = errors.New("gpu: the device cannot map pinned host memory (no cuMemHostGetDevicePointer, or CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY is 0): the copy kernel is off")
	}
	return b, nil
}

func (b *cudaBackend) name() string                { return b.devName }
func (b *cudaBackend) driverVersion() int          { return b.drv.version }
func (b *cudaBackend) totalMemory() (int64, error) { return b.total, nil }

func (b *cudaBackend) freeMemory() (int64, error) {
	var free, total C.size_t
	if r := C.kvl_mem_get_info(b.drv.api, b.ctx, &free, &total); r != 0 {
		return 0, b.drv.err("cuMemGetInfo", r)
	}
	return int64(free), nil
}

func (b *cudaBackend) allocDevice(n int) (uint64, []byte, error) {
	var p C.CUdeviceptr
	if r := C.kvl_mem_alloc(b.drv.api, b.ctx, &p, C.size_t(n)); r != 0 {
		return 0, nil, b.drv.err("cuMemAlloc", r)
	}
	return uint64(p), nil, nil
}

func (b *cudaBackend) freeDevice(addr uint64, _ int) error {
	return b.drv.err("cuMemFree", C.kvl_mem_free(b.drv.api, b.ctx, C.CUdeviceptr(addr)))
}

func (b *cudaBackend) multiprocessors() int { return b.sms }

func (b *cudaBackend) allocPinned(n int) ([]byte, uint64, error) {
	var (
		p    unsafe.Pointer
		dptr C.CUdeviceptr
	)
	mapIt := C.int(0)
	if b.canMap {
		mapIt = 1
	}
	if r := C.kvl_host_alloc(b.drv.api, b.ctx, &p, C.size_t(n), mapIt, &dptr); r != 0 {
		return nil, 0, b.drv.err("cuMemHostAlloc", r)
	}
	return unsafe.Slice((*byte)(p), n), uint64(dptr), nil
}

func (b *cudaBackend) freePinned(mem []byte) error {
	return b.drv.err("cuMemFreeHost", C.kvl_host_free(b.drv.api, b.ctx, unsafe.Pointer(unsafe.SliceData(mem))))
}

func (b *cudaBackend) readDevice(dst []byte, a *arena, off int) error {
	r := C.kvl_dtoh(b.drv.api, b.ctx, unsafe.Pointer(unsafe.SliceData(dst)), C.CUdeviceptr(a.addr+uint64(off)), C.size_t(len(dst)))
	return b.drv.err("cuMemcpyDtoH", r)
}

func (b *cudaBackend) writeDevice(a *arena, off int, src []byte) error {
	r := C.kvl_htod(b.drv.api, b.ctx, C.CUdeviceptr(a.addr+uint64(off)), unsafe.Pointer(unsafe.SliceData(src)), C.size_t(len(src)))
	return b.drv.err("cuMemcpyHtoD", r)
}

func (b *cudaBackend) close() error {
	b.kernMu.Lock()
	mod := b.kernMod
	b.kernMod, b.kernFn = 0, 0
	b.kernReady.Store(false)
	if b.kernErr == nil {
		b.kernErr = ErrClosed
	}
	b.kernMu.Unlock()
	var errs []error
	if mod != 0 {
		errs = append(errs, b.drv.err("cuModuleUnload", C.kvl_module_unload(b.drv.api, b.ctx, mod)))
	}
	errs = append(errs, b.drv.err("cuDevicePrimaryCtxRelease", C.kvl_ctx_release(b.drv.api, b.dev)))
	return errors.Join(errs...)
}

func (b *cudaBackend) counters() *counters { return &b.ctr }

func (b *cudaBackend) pathState() (bool, error) {
	b.kernMu.Lock()
	defer b.kernMu.Unlock()
	return b.useBatch.Load(), b.kernErr
}

// loadKernel loads the copy kernel at the first call (the driver
// JIT-compiles the PTX for the device) and returns why it cannot run, if
// it cannot.
func (b *cudaBackend) loadKernel() error {
	if b.kernReady.Load() {
		return nil
	}
	b.kernMu.Lock()
	defer b.kernMu.Unlock()
	if b.kernFn != 0 || b.kernErr != nil {
		return b.kernErr
	}
	image := C.CString(kernelPTX)
	defer C.free(unsafe.Pointer(image))
	entry := C.CString(kernelEntry)
	defer C.free(unsafe.Pointer(entry))
	var log [4096]C.char
	var mod, fn C.uintptr_t
	if r := C.kvl_module_load(b.drv.api, b.ctx, image, entry, &mod, &fn, &log[0], C.size_t(len(log))); r != 0 {
		err := b.drv.err("cuModuleLoadData", r)
		if msg := C.GoString(&log[0]); msg != "" {
			err = fmt.Errorf("%w; JIT log: %s", err, msg)
		}
		b.kernErr = fmt.Errorf("gpu: loading the copy kernel: %w", err)
		return b.kernErr
	}
	b.kernMod, b.kernFn = mod, fn
	b.kernReady.Store(true)
	return nil
}

// kernel returns the loaded kernel's function, 0 when it is off.
func (b *cudaBackend) kernel() C.uintptr_t {
	if !b.kernReady.Load() {
		return 0
	}
	b.kernMu.Lock()
	defer b.kernMu.Unlock()
	return b.kernFn
}

// kernelFailed turns the kernel off after a failed launch.
func (b *cudaBackend) kernelFailed(err error) {
	b.kernMu.Lock()
	if b.kernErr == nil {
		b.kernErr = fmt.Errorf("gpu: launching the copy kernel: %w", err)
	}
	b.kernReady.Store(false)
	b.kernMu.Unlock()
	b.ctr.kernelFailures.Add(1)
}

// deviceAttrs returns the compute capability and SM count, or zeros when
// the driver cannot say.
func (b *cudaBackend) deviceAttrs() (major, minor, sms int) {
	var v C.int
	if C.kvl_device_attr(b.drv.api, b.dev, C.KVL_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, &v) == 0 {
		major = int(v)
	}
	if C.kvl_device_attr(b.drv.api, b.dev, C.KVL_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, &v) == 0 {
		minor = int(v)
	}
	if C.kvl_device_attr(b.drv.api, b.dev, C.KVL_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, &v) == 0 {
		sms = int(v)
	}
	return major, minor, sms
}

func (b *cudaBackend) newStream() (stream, error) {
	var h C.uintptr_t
	if r := C.kvl_stream_create(b.drv.api, b.ctx, &h); r != 0 {
		return nil, b.drv.err("cuStreamCreate", r)
	}
	return &cudaStream{b: b, h: h}, nil
}

// cudaStream is a non-blocking CUDA stream with a free list of fences.
// submit is only called by one goroutine at a time (its engine's
// submission lock), so the copy arrays need no lock of their own; the free
// list does (wait and recycle run on the completion goroutine).
type cudaStream struct {
	b *cudaBackend
	h C.uintptr_t
	// Reused submission arrays (Go memory, read by C during the call only):
	// one copy per index; and the call's arguments and result (fields
	// without Go pointers, so C may be handed their addresses).
	dsts, srcs []C.CUdeviceptr
	sizes      []C.size_t
	args       C.kvl_submit_args
	res        C.kvl_submit_result

	mu     sync.Mutex
	fences []*cudaFence
}

// cudaFence is one submission's completion event, with the timing
// events. Fences are recycled, never freed before destroy.
type cudaFence struct {
	ev, start, end C.uintptr_t
	timed          bool
}

func (s *cudaStream) fence() (*cudaFence, error) {
	s.mu.Lock()
	if n := len(s.fences); n > 0 {
		f := s.fences[n-1]
		s.fences = s.fences[:n-1]
		s.mu.Unlock()
		return f, nil
	}
	s.mu.Unlock()
	f := &cudaFence{}
	if r := C.kvl_event_create(s.b.drv.api, s.b.ctx, &f.ev); r != 0 {
		return nil, s.b.drv.err("cuEventCreate", r)
	}
	return f, nil
}

// timingEvents makes sure f has its two timing events.
func (s *cudaStream) timingEvents(f *cudaFence) bool {
	if f.start != 0 {
		return true
	}
	if C.kvl_has_timing(s.b.drv.api) == 0 {
		return false
	}
	var start, end C.uintptr_t
	if C.kvl_event_create_timed(s.b.drv.api, s.b.ctx, &start) != 0 {
		return false
	}
	if C.kvl_event_create_timed(s.b.drv.api, s.b.ctx, &end) != 0 {
		_ = C.kvl_event_destroy(s.b.drv.api, s.b.ctx, start)
		return false
	}
	f.start, f.end = start, end
	return true
}

func (s *cudaStream) submit(sub *submission) (fence, error, error) {
	b, drv := s.b, s.b.drv
	f, err := s.fence()
	if err != nil {
		return nil, err, nil // nothing enqueued
	}
	ops := sub.ops
	s.dsts, s.srcs, s.sizes = s.dsts[:0], s.srcs[:0], s.sizes[:0]
	for i := range ops {
		op := &ops[i]
		s.dsts = append(s.dsts, C.CUdeviceptr(op.dst.addr+uint64(op.dstOff)))
		s.srcs = append(s.srcs, C.CUdeviceptr(op.src.addr+uint64(op.srcOff)))
		s.sizes = append(s.sizes, C.size_t(op.n))
	}
	args := &s.args
	*args = C.kvl_submit_args{
		ctx: s.b.ctx, stream: s.h, ev: f.ev,
		n: C.size_t(len(ops)),
	}
	switch sub.kind {
	case hostToDevice:
		args.kind = C.KVL_HTOD
	case deviceToHost:
		args.kind = C.KVL_DTOH
	default:
		args.kind = C.KVL_DTOD
	}
	if b.useBatch.Load() {
		args.useBatch = 1
	}
	if b.ctr.timing.Load() && s.timingEvents(f) {
		args.start, args.end = f.start, f.end
	}
	if sub.kernel {
		if fn := b.kernel(); fn != 0 {
			l := sub.launch
			args.fn = fn
			args.table = C.CUdeviceptr(l.table)
			args.ncta, args.nwarp = C.uint(l.ncta), C.uint(l.nwarp)
			args.grid, args.threads = C.uint(l.grid), kernelThreads
		}
		// A kernel that failed meanwhile leaves the copy to the copy engine.
	}
	res := &s.res
	C.kvl_submit(drv.api, args, &s.dsts[0], &s.srcs[0], &s.sizes[0], res)
	if res.pushFailed != 0 {
		s.recycle(f)
		return nil, drv.err("cuCtxPushCurrent", res.enqueue), nil
	}
	sub.ctr.count(copyPath(res.path), len(ops))
	if res.path == C.KVL_PATH_KERNEL {
		sub.ctr.kernelCTAs.Add(int64(sub.launch.grid))
	}
	if res.kernelFailed != 0 {
		b.kernelFailed(drv.err("cuLaunchKernel", res.kernelErr))
	}
	if res.batchFailed != 0 && res.enqueue == 0 {
		// The loop did what the batch could not: stop asking for batches.
		b.useBatch.Store(false)
		b.ctr.batchFailures.Add(1)
	}
	f.timed = res.timed != 0
	var outcome error
	if res.enqueue != 0 {
		outcome = fmt.Errorf("gpu: %d of %d copies enqueued: %w", int(res.enqueued), len(ops), drv.err("cuMemcpyAsync", res.enqueue))
	}
	if res.record == 0 {
		return f, outcome, nil
	}
	recErr := drv.err("cuEventRecord", res.record)
	if res.sync == 0 { // the stream drained: nothing of ours is in flight
		s.recycle(f)
		return nil, errors.Join(outcome, recErr), nil
	}
	// The stream may still be copying (and the kernel reading its table):
	// the fence is never recycled and the engine quarantines the transfer.
	return nil, nil, errors.Join(outcome, recErr, drv.err("cuStreamSynchronize", res.sync))
}

func (s *cudaStream) wait(fc fence) (outcome, failure error) {
	f := fc.(*cudaFence)
	if r := C.kvl_event_sync(s.b.drv.api, s.b.ctx, f.ev); r != 0 {
		return nil, s.b.drv.err("cuEventSynchronize", r)
	}
	if f.timed {
		var ms C.float
		if C.kvl_elapsed(s.b.drv.api, s.b.ctx, f.start, f.end, &ms) == 0 {
			s.b.ctr.addGPUTime(time.Duration(float64(ms) * float64(time.Millisecond)))
		}
		f.timed = false
	}
	return nil, nil
}

func (s *cudaStream) recycle(fc fence) {
	s.mu.Lock()
	s.fences = append(s.fences, fc.(*cudaFence))
	s.mu.Unlock()
}

func (s *cudaStream) destroy() error {
	drv := s.b.drv
	s.mu.Lock()
	fences := s.fences
	s.fences = nil
	s.mu.Unlock()
	var errs []error
	// The stream first: destroying it waits for nothing, but every fence
	// here has completed.
	errs = append(errs, drv.err("cuStreamDestroy", C.kvl_stream_destroy(drv.api, s.b.ctx, s.h)))
	for _, f := range fences {
		errs = append(errs, drv.err("cuEventDestroy", C.kvl_event_destroy(drv.api, s.b.ctx, f.ev)))
		if f.start != 0 {
			errs = append(errs, drv.err("cuEventDestroy", C.kvl_event_destroy(drv.api, s.b.ctx, f.start)))
			errs = append(errs, drv.err("cuEventDestroy", C.kvl_event_destroy(drv.api, s.b.ctx, f.end)))
		}
	}
	return errors.Join(errs...)
}

// cudaStats reports how submissions were carried on a CUDA device: as one
// cuMemcpyBatchAsync or as a loop of cuMemcpy*Async. ok is false on the
// fallback.
func cudaStats(d *Device) (batched, looped int64, batchAvailable, ok bool) {
	if _, isCUDA := d.b.(*cudaBackend); !isCUDA {
		return 0, 0, false, false
	}
	st := d.CopyStats()
	return st.BatchedSubmits, st.LoopedSubmits, st.BatchEnabled, true
}

// setBatch turns the batched path on or off (when the driver has it), for
// benchmarks comparing the two.
func setBatch(d *Device, on bool) {
	if b, isCUDA := d.b.(*cudaBackend); isCUDA {
		b.useBatch.Store(on && C.kvl_has_batch(b.drv.api) != 0)
	}
}

// deviceAttrs returns d's compute capability and SM count (zeros on the
// fallback or when the driver cannot say).
func deviceAttrs(d *Device) (major, minor, sms int) {
	if b, isCUDA := d.b.(*cudaBackend); isCUDA {
		return b.deviceAttrs()
	}
	return 0, 0, 0
}
