//go:build cgo && linux

package gpu

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cudadrv.h"

typedef struct {
	const char *name;      // base name, for cuGetProcAddress
	const char *versioned; // exported name with the same ABI, for dlsym
	int version;           // ABI version asked of cuGetProcAddress
	int optional;
} kvl_sym;

// One entry per kvl_api field, in field order.
static const kvl_sym kvl_symbols[] = {
	{"cuInit", "cuInit", KVL_CUDA_VERSION, 0},
	{"cuDriverGetVersion", "cuDriverGetVersion", KVL_CUDA_VERSION, 0},
	{"cuGetErrorName", "cuGetErrorName", KVL_CUDA_VERSION, 0},
	{"cuGetErrorString", "cuGetErrorString", KVL_CUDA_VERSION, 0},
	{"cuDeviceGetCount", "cuDeviceGetCount", KVL_CUDA_VERSION, 0},
	{"cuDeviceGet", "cuDeviceGet", KVL_CUDA_VERSION, 0},
	{"cuDeviceGetName", "cuDeviceGetName", KVL_CUDA_VERSION, 0},
	{"cuDeviceTotalMem", "cuDeviceTotalMem_v2", KVL_CUDA_VERSION, 0},
	{"cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", KVL_CUDA_VERSION, 0},
	{"cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2", KVL_CUDA_VERSION, 0},
	{"cuCtxPushCurrent", "cuCtxPushCurrent_v2", KVL_CUDA_VERSION, 0},
	{"cuCtxPopCurrent", "cuCtxPopCurrent_v2", KVL_CUDA_VERSION, 0},
	{"cuMemGetInfo", "cuMemGetInfo_v2", KVL_CUDA_VERSION, 0},
	{"cuMemAlloc", "cuMemAlloc_v2", KVL_CUDA_VERSION, 0},
	{"cuMemFree", "cuMemFree_v2", KVL_CUDA_VERSION, 0},
	{"cuMemHostAlloc", "cuMemHostAlloc", KVL_CUDA_VERSION, 0},
	{"cuMemFreeHost", "cuMemFreeHost", KVL_CUDA_VERSION, 0},
	{"cuStreamCreate", "cuStreamCreate", KVL_CUDA_VERSION, 0},
	{"cuStreamDestroy", "cuStreamDestroy_v2", KVL_CUDA_VERSION, 0},
	{"cuStreamSynchronize", "cuStreamSynchronize", KVL_CUDA_VERSION, 0},
	{"cuEventCreate", "cuEventCreate", KVL_CUDA_VERSION, 0},
	{"cuEventDestroy", "cuEventDestroy_v2", KVL_CUDA_VERSION, 0},
	{"cuEventRecord", "cuEventRecord", KVL_CUDA_VERSION, 0},
	{"cuEventSynchronize", "cuEventSynchronize", KVL_CUDA_VERSION, 0},
	{"cuEventQuery", "cuEventQuery", KVL_CUDA_VERSION, 0},
	{"cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2", KVL_CUDA_VERSION, 0},
	{"cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2", KVL_CUDA_VERSION, 0},
	{"cuMemcpyDtoDAsync", "cuMemcpyDtoDAsync_v2", KVL_CUDA_VERSION, 0},
	{"cuMemcpyHtoD", "cuMemcpyHtoD_v2", KVL_CUDA_VERSION, 0},
	{"cuMemcpyDtoH", "cuMemcpyDtoH_v2", KVL_CUDA_VERSION, 0},
	{"cuMemcpyBatchAsync", "cuMemcpyBatchAsync", KVL_CUDA_VERSION_BATCH, 1},
};

_Static_assert(sizeof(kvl_api) == sizeof(kvl_symbols) / sizeof(kvl_symbols[0]) * sizeof(void *),
               "kvl_api and kvl_symbols disagree");

// kvl_load opens the driver and fills api. Returns 0 on success, 1 when
// dlopen fails, 2 when a required entry point is missing; msg says which.
// *resolver is 2 for cuGetProcAddress_v2, 1 for cuGetProcAddress, 0 for
// dlsym alone.
static int kvl_load(const char *path, kvl_api *api, uintptr_t *handle, int *resolver, char *msg, size_t msglen) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char *e = dlerror();
		snprintf(msg, msglen, "%s", e ? e : "dlopen failed");
		return 1;
	}
	kvl_cuGetProcAddress_v2_t gpa2 = (kvl_cuGetProcAddress_v2_t)dlsym(h, "cuGetProcAddress_v2");
	kvl_cuGetProcAddress_v1_t gpa1 = gpa2 ? NULL : (kvl_cuGetProcAddress_v1_t)dlsym(h, "cuGetProcAddress");
	void **slots = (void **)api;
	size_t n = sizeof(kvl_symbols) / sizeof(kvl_symbols[0]);
	for (size_t i = 0; i < n; i++) {
		const kvl_sym *s = &kvl_symbols[i];
		void *fn = NULL;
		if (gpa2) {
			int status = 0;
			if (gpa2(s->name, &fn, s->version, KVL_CU_GET_PROC_ADDRESS_DEFAULT, &status) != KVL_CUDA_SUCCESS || status != 0) {
				fn = NULL;
			}
		} else if (gpa1) {
			if (gpa1(s->name, &fn, s->version, KVL_CU_GET_PROC_ADDRESS_DEFAULT) != KVL_CUDA_SUCCESS) {
				fn = NULL;
			}
		}
		if (fn == NULL) {
			fn = dlsym(h, s->versioned);
		}
		if (fn == NULL && !s->optional) {
			snprintf(msg, msglen, "%s", s->versioned);
			dlclose(h);
			return 2;
		}
		slots[i] = fn;
	}
	*handle = (uintptr_t)h;
	*resolver = gpa2 ? 2 : gpa1 ? 1 : 0;
	return 0;
}

static int kvl_has_batch(kvl_api *api) { return api->cuMemcpyBatchAsync != NULL; }

static CUresult kvl_init(kvl_api *api, int *version) {
	CUresult r = api->cuInit(0);
	if (r != KVL_CUDA_SUCCESS) return r;
	return api->cuDriverGetVersion(version);
}

static void kvl_error_strings(kvl_api *api, CUresult code, const char **name, const char **str) {
	*name = NULL;
	*str = NULL;
	if (api->cuGetErrorName(code, name) != KVL_CUDA_SUCCESS) *name = NULL;
	if (api->cuGetErrorString(code, str) != KVL_CUDA_SUCCESS) *str = NULL;
}

static CUresult kvl_device_count(kvl_api *api, int *n) { return api->cuDeviceGetCount(n); }
static CUresult kvl_device_get(kvl_api *api, CUdevice *dev, int ordinal) { return api->cuDeviceGet(dev, ordinal); }
static CUresult kvl_device_name(kvl_api *api, char *name, int len, CUdevice dev) { return api->cuDeviceGetName(name, len, dev); }
static CUresult kvl_device_total(kvl_api *api, size_t *bytes, CUdevice dev) { return api->cuDeviceTotalMem(bytes, dev); }

static CUresult kvl_ctx_retain(kvl_api *api, CUdevice dev, uintptr_t *ctx) {
	CUcontext c = NULL;
	CUresult r = api->cuDevicePrimaryCtxRetain(&c, dev);
	*ctx = (uintptr_t)c;
	return r;
}
static CUresult kvl_ctx_release(kvl_api *api, CUdevice dev) { return api->cuDevicePrimaryCtxRelease(dev); }

// Every call that needs the context pushes it on the calling thread and
// pops it before returning: goroutines move between threads, and the
// thread's own current context (if the program has one) is left as it was.
#define KVL_WITH_CTX(api, ctx, call)                                        \
	do {                                                                    \
		CUresult r_ = (api)->cuCtxPushCurrent((CUcontext)(ctx));            \
		if (r_ != KVL_CUDA_SUCCESS) return r_;                              \
		r_ = (call);                                                        \
		CUcontext popped_;                                                  \
		(api)->cuCtxPopCurrent(&popped_);                                   \
		return r_;                                                          \
	} while (0)

static CUresult kvl_mem_get_info(kvl_api *api, uintptr_t ctx, size_t *free_, size_t *total) {
	KVL_WITH_CTX(api, ctx, api->cuMemGetInfo(free_, total));
}
static CUresult kvl_mem_alloc(kvl_api *api, uintptr_t ctx, CUdeviceptr *p, size_t n) {
	KVL_WITH_CTX(api, ctx, api->cuMemAlloc(p, n));
}
static CUresult kvl_mem_free(kvl_api *api, uintptr_t ctx, CUdeviceptr p) {
	KVL_WITH_CTX(api, ctx, api->cuMemFree(p));
}
static CUresult kvl_host_alloc(kvl_api *api, uintptr_t ctx, void **p, size_t n) {
	KVL_WITH_CTX(api, ctx, api->cuMemHostAlloc(p, n, KVL_CU_MEMHOSTALLOC_PORTABLE));
}
static CUresult kvl_host_free(kvl_api *api, uintptr_t ctx, void *p) {
	KVL_WITH_CTX(api, ctx, api->cuMemFreeHost(p));
}
static CUresult kvl_stream_create(kvl_api *api, uintptr_t ctx, uintptr_t *s) {
	CUstream st = NULL;
	CUresult r = api->cuCtxPushCurrent((CUcontext)ctx);
	if (r != KVL_CUDA_SUCCESS) return r;
	r = api->cuStreamCreate(&st, KVL_CU_STREAM_NON_BLOCKING);
	CUcontext popped;
	api->cuCtxPopCurrent(&popped);
	*s = (uintptr_t)st;
	return r;
}
static CUresult kvl_stream_destroy(kvl_api *api, uintptr_t ctx, uintptr_t s) {
	KVL_WITH_CTX(api, ctx, api->cuStreamDestroy((CUstream)s));
}
// Events sleep in cuEventSynchronize (blocking sync) instead of spinning,
// and skip timing.
static CUresult kvl_event_create(kvl_api *api, uintptr_t ctx, uintptr_t *e) {
	CUevent ev = NULL;
	CUresult r = api->cuCtxPushCurrent((CUcontext)ctx);
	if (r != KVL_CUDA_SUCCESS) return r;
	r = api->cuEventCreate(&ev, KVL_CU_EVENT_BLOCKING_SYNC | KVL_CU_EVENT_DISABLE_TIMING);
	CUcontext popped;
	api->cuCtxPopCurrent(&popped);
	*e = (uintptr_t)ev;
	return r;
}
static CUresult kvl_event_destroy(kvl_api *api, uintptr_t ctx, uintptr_t e) {
	KVL_WITH_CTX(api, ctx, api->cuEventDestroy((CUevent)e));
}
static CUresult kvl_event_sync(kvl_api *api, uintptr_t ctx, uintptr_t e) {
	KVL_WITH_CTX(api, ctx, api->cuEventSynchronize((CUevent)e));
}
static CUresult kvl_dtoh(kvl_api *api, uintptr_t ctx, void *dst, CUdeviceptr src, size_t n) {
	KVL_WITH_CTX(api, ctx, api->cuMemcpyDtoH(dst, src, n));
}
// A synchronous upload from pageable memory may return once the source is
// staged, before the DMA has landed, and the engine's non-blocking streams
// are not ordered after the legacy stream it ran on: synchronize that
// stream (NULL) before returning, so the bytes are in device memory when
// CopyFromHost returns.
static CUresult kvl_htod(kvl_api *api, uintptr_t ctx, CUdeviceptr dst, const void *src, size_t n) {
	CUresult r = api->cuCtxPushCurrent((CUcontext)ctx);
	if (r != KVL_CUDA_SUCCESS) return r;
	r = api->cuMemcpyHtoD(dst, src, n);
	if (r == KVL_CUDA_SUCCESS) r = api->cuStreamSynchronize(NULL);
	CUcontext popped;
	api->cuCtxPopCurrent(&popped);
	return r;
}

static CUresult kvl_copy_one(kvl_api *api, const kvl_op *op, CUstream s) {
	switch (op->kind) {
	case KVL_HTOD:
		return api->cuMemcpyHtoDAsync(op->dst, (const void *)(uintptr_t)op->src, op->bytes, s);
	case KVL_DTOH:
		return api->cuMemcpyDtoHAsync((void *)(uintptr_t)op->dst, op->src, op->bytes, s);
	default:
		return api->cuMemcpyDtoDAsync(op->dst, op->src, op->bytes, s);
	}
}

// kvl_submit enqueues ops on stream s and records event ev after them, in
// one call so that the context stays current throughout. With useBatch and
// more than one op it tries one cuMemcpyBatchAsync first; if that fails it
// enqueues the copies one by one (copying a block twice from an unchanged
// source is harmless). If the event cannot be recorded it synchronizes the
// stream, so the caller learns whether anything can still be in flight.
// The op arrays are read during the call only.
static void kvl_submit(kvl_api *api, uintptr_t ctx, uintptr_t stream, uintptr_t ev, const kvl_op *ops, size_t n,
                       int useBatch, kvl_submit_result *res) {
	memset(res, 0, sizeof *res);
	CUstream s = (CUstream)stream;
	CUresult r = api->cuCtxPushCurrent((CUcontext)ctx);
	if (r != KVL_CUDA_SUCCESS) {
		res->pushFailed = 1;
		res->enqueue = r;
		return;
	}
	int loop = 1;
	if (useBatch && n > 1 && api->cuMemcpyBatchAsync != NULL) {
		CUdeviceptr *dsts = malloc(n * sizeof *dsts);
		CUdeviceptr *srcs = malloc(n * sizeof *srcs);
		size_t *sizes = malloc(n * sizeof *sizes);
		if (dsts && srcs && sizes) {
			for (size_t i = 0; i < n; i++) {
				dsts[i] = ops[i].dst;
				srcs[i] = ops[i].src;
				sizes[i] = ops[i].bytes;
			}
			kvl_CUmemcpyAttributes attr;
			memset(&attr, 0, sizeof attr);
			attr.srcAccessOrder = KVL_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
			size_t attrIdx = 0, failIdx = SIZE_MAX;
			r = api->cuMemcpyBatchAsync(dsts, srcs, sizes, n, &attr, &attrIdx, 1, &failIdx, s);
			if (r == KVL_CUDA_SUCCESS) {
				res->batched = 1;
				res->enqueued = n;
				loop = 0;
			} else {
				res->batchFailed = 1;
				res->batchErr = r;
			}
		}
		free(dsts);
		free(srcs);
		free(sizes);
	}
	if (loop) {
		for (size_t i = 0; i < n; i++) {
			r = kvl_copy_one(api, &ops[i], s);
			if (r != KVL_CUDA_SUCCESS) {
				res->enqueue = r;
				break;
			}
			res->enqueued++;
		}
	}
	res->record = api->cuEventRecord((CUevent)ev, s);
	if (res->record != KVL_CUDA_SUCCESS) {
		res->sync = api->cuStreamSynchronize(s);
	}
	CUcontext popped;
	api->cuCtxPopCurrent(&popped);
}
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"
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

	// Counters of submissions, by path; read by tests and the device check.
	batchedSubmits atomic.Int64
	loopSubmits    atomic.Int64
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

func (b *cudaBackend) allocPinned(n int) ([]byte, error) {
	var p unsafe.Pointer
	if r := C.kvl_host_alloc(b.drv.api, b.ctx, &p, C.size_t(n)); r != 0 {
		return nil, b.drv.err("cuMemHostAlloc", r)
	}
	return unsafe.Slice((*byte)(p), n), nil
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
	return b.drv.err("cuDevicePrimaryCtxRelease", C.kvl_ctx_release(b.drv.api, b.dev))
}

func (b *cudaBackend) newStream() (stream, error) {
	var h C.uintptr_t
	if r := C.kvl_stream_create(b.drv.api, b.ctx, &h); r != 0 {
		return nil, b.drv.err("cuStreamCreate", r)
	}
	return &cudaStream{b: b, h: h}, nil
}

// cudaStream is a non-blocking CUDA stream with a free list of events.
// submit is only called under its engine's lock, so ops needs no lock of
// its own; events does (wait and recycle run on the completion goroutine).
type cudaStream struct {
	b   *cudaBackend
	h   C.uintptr_t
	ops []C.kvl_op // reused submission buffer (Go memory, read by C during the call only)

	mu     sync.Mutex
	events []C.uintptr_t
}

func (s *cudaStream) event() (C.uintptr_t, error) {
	s.mu.Lock()
	if n := len(s.events); n > 0 {
		ev := s.events[n-1]
		s.events = s.events[:n-1]
		s.mu.Unlock()
		return ev, nil
	}
	s.mu.Unlock()
	var ev C.uintptr_t
	if r := C.kvl_event_create(s.b.drv.api, s.b.ctx, &ev); r != 0 {
		return 0, s.b.drv.err("cuEventCreate", r)
	}
	return ev, nil
}

func (s *cudaStream) submit(ops []copyOp, _ *atomic.Bool) (fence, error, error) {
	drv := s.b.drv
	ev, err := s.event()
	if err != nil {
		return nil, err, nil // nothing enqueued
	}
	s.ops = s.ops[:0]
	for _, op := range ops {
		kind := C.KVL_DTOD
		switch {
		case op.src.kind == pinnedMem:
			kind = C.KVL_HTOD
		case op.dst.kind == pinnedMem:
			kind = C.KVL_DTOH
		}
		s.ops = append(s.ops, C.kvl_op{
			dst:   C.CUdeviceptr(op.dst.addr + uint64(op.dstOff)),
			src:   C.CUdeviceptr(op.src.addr + uint64(op.srcOff)),
			bytes: C.size_t(op.n),
			kind:  C.int(kind),
		})
	}
	useBatch := 0
	if s.b.useBatch.Load() {
		useBatch = 1
	}
	var res C.kvl_submit_result
	C.kvl_submit(drv.api, s.b.ctx, s.h, ev, &s.ops[0], C.size_t(len(s.ops)), C.int(useBatch), &res)
	if res.pushFailed != 0 {
		s.recycle(ev)
		return nil, drv.err("cuCtxPushCurrent", res.enqueue), nil
	}
	if res.batched != 0 {
		s.b.batchedSubmits.Add(1)
	} else {
		s.b.loopSubmits.Add(1)
	}
	if res.batchFailed != 0 && res.enqueue == 0 {
		// The loop did what the batch could not: stop asking for batches.
		s.b.useBatch.Store(false)
	}
	var outcome error
	if res.enqueue != 0 {
		outcome = fmt.Errorf("gpu: %d of %d copies enqueued: %w", int(res.enqueued), len(s.ops), drv.err("cuMemcpyAsync", res.enqueue))
	}
	if res.record == 0 {
		return ev, outcome, nil
	}
	recErr := drv.err("cuEventRecord", res.record)
	if res.sync == 0 { // the stream drained: nothing of ours is in flight
		_ = C.kvl_event_destroy(drv.api, s.b.ctx, ev)
		return nil, errors.Join(outcome, recErr), nil
	}
	return nil, nil, errors.Join(outcome, recErr, drv.err("cuStreamSynchronize", res.sync))
}

func (s *cudaStream) wait(f fence) (outcome, failure error) {
	ev := f.(C.uintptr_t)
	if r := C.kvl_event_sync(s.b.drv.api, s.b.ctx, ev); r != 0 {
		return nil, s.b.drv.err("cuEventSynchronize", r)
	}
	return nil, nil
}

func (s *cudaStream) recycle(f fence) {
	s.mu.Lock()
	s.events = append(s.events, f.(C.uintptr_t))
	s.mu.Unlock()
}

func (s *cudaStream) destroy() error {
	drv := s.b.drv
	s.mu.Lock()
	events := s.events
	s.events = nil
	s.mu.Unlock()
	var errs []error
	for _, ev := range events {
		errs = append(errs, drv.err("cuEventDestroy", C.kvl_event_destroy(drv.api, s.b.ctx, ev)))
	}
	errs = append(errs, drv.err("cuStreamDestroy", C.kvl_stream_destroy(drv.api, s.b.ctx, s.h)))
	return errors.Join(errs...)
}

// cudaStats reports how submissions were carried on a CUDA device: as one
// cuMemcpyBatchAsync or as a loop of cuMemcpy*Async. ok is false on the
// fallback.
func cudaStats(d *Device) (batched, looped int64, batchAvailable, ok bool) {
	b, isCUDA := d.b.(*cudaBackend)
	if !isCUDA {
		return 0, 0, false, false
	}
	return b.batchedSubmits.Load(), b.loopSubmits.Load(), b.useBatch.Load(), true
}

// setBatch turns the batched path on or off (when the driver has it), for
// benchmarks comparing the two.
func setBatch(d *Device, on bool) {
	if b, isCUDA := d.b.(*cudaBackend); isCUDA {
		b.useBatch.Store(on && C.kvl_has_batch(b.drv.api) != 0)
	}
}
