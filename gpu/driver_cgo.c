//go:build cgo && linux

// The C side of the CUDA driver binding (driver_cgo.go): the driver's
// entry points loaded at run time and the shims Go calls them through
// (cgo cannot call a C function pointer). Declared in driver_shims.h.

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cudadrv.h"
#include "driver_shims.h"

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
	{"cuModuleLoadData", "cuModuleLoadData", KVL_CUDA_VERSION, 1},
	{"cuModuleLoadDataEx", "cuModuleLoadDataEx", KVL_CUDA_VERSION, 1},
	{"cuModuleUnload", "cuModuleUnload", KVL_CUDA_VERSION, 1},
	{"cuModuleGetFunction", "cuModuleGetFunction", KVL_CUDA_VERSION, 1},
	{"cuLaunchKernel", "cuLaunchKernel", KVL_CUDA_VERSION, 1},
	{"cuEventElapsedTime", "cuEventElapsedTime", KVL_CUDA_VERSION, 1},
	{"cuDeviceGetAttribute", "cuDeviceGetAttribute", KVL_CUDA_VERSION, 1},
	{"cuMemHostGetDevicePointer", "cuMemHostGetDevicePointer_v2", KVL_CUDA_VERSION, 1},
};

_Static_assert(sizeof(kvl_api) == sizeof(kvl_symbols) / sizeof(kvl_symbols[0]) * sizeof(void *),
               "kvl_api and kvl_symbols disagree");

// kvl_load opens the driver and fills api. Returns 0 on success, 1 when
// dlopen fails, 2 when a required entry point is missing; msg says which.
// *resolver is 2 for cuGetProcAddress_v2, 1 for cuGetProcAddress, 0 for
// dlsym alone.
int kvl_load(const char *path, kvl_api *api, uintptr_t *handle, int *resolver, char *msg, size_t msglen) {
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

int kvl_has_batch(kvl_api *api) { return api->cuMemcpyBatchAsync != NULL; }

CUresult kvl_init(kvl_api *api, int *version) {
	CUresult r = api->cuInit(0);
	if (r != KVL_CUDA_SUCCESS) return r;
	return api->cuDriverGetVersion(version);
}

void kvl_error_strings(kvl_api *api, CUresult code, const char **name, const char **str) {
	*name = NULL;
	*str = NULL;
	if (api->cuGetErrorName(code, name) != KVL_CUDA_SUCCESS) *name = NULL;
	if (api->cuGetErrorString(code, str) != KVL_CUDA_SUCCESS) *str = NULL;
}

CUresult kvl_device_count(kvl_api *api, int *n) { return api->cuDeviceGetCount(n); }
CUresult kvl_device_get(kvl_api *api, CUdevice *dev, int ordinal) { return api->cuDeviceGet(dev, ordinal); }
CUresult kvl_device_name(kvl_api *api, char *name, int len, CUdevice dev) { return api->cuDeviceGetName(name, len, dev); }
CUresult kvl_device_total(kvl_api *api, size_t *bytes, CUdevice dev) { return api->cuDeviceTotalMem(bytes, dev); }

CUresult kvl_ctx_retain(kvl_api *api, CUdevice dev, uintptr_t *ctx) {
	CUcontext c = NULL;
	CUresult r = api->cuDevicePrimaryCtxRetain(&c, dev);
	*ctx = (uintptr_t)c;
	return r;
}
CUresult kvl_ctx_release(kvl_api *api, CUdevice dev) { return api->cuDevicePrimaryCtxRelease(dev); }

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

CUresult kvl_mem_get_info(kvl_api *api, uintptr_t ctx, size_t *free_, size_t *total) {
	KVL_WITH_CTX(api, ctx, api->cuMemGetInfo(free_, total));
}
CUresult kvl_mem_alloc(kvl_api *api, uintptr_t ctx, CUdeviceptr *p, size_t n) {
	KVL_WITH_CTX(api, ctx, api->cuMemAlloc(p, n));
}
CUresult kvl_mem_free(kvl_api *api, uintptr_t ctx, CUdeviceptr p) {
	KVL_WITH_CTX(api, ctx, api->cuMemFree(p));
}
// kvl_host_alloc allocates pinned memory, portable to every context. With
// map set (and the driver able to), it is mapped into the device's address
// space and *dptr is its device address; otherwise *dptr is 0.
static CUresult kvl_host_alloc_in_ctx(kvl_api *api, void **p, size_t n, int map, CUdeviceptr *dptr) {
	*dptr = 0;
	unsigned int flags = KVL_CU_MEMHOSTALLOC_PORTABLE;
	if (map) flags |= KVL_CU_MEMHOSTALLOC_DEVICEMAP;
	CUresult r = api->cuMemHostAlloc(p, n, flags);
	if (r != KVL_CUDA_SUCCESS || !map) return r;
	if (api->cuMemHostGetDevicePointer(dptr, *p, 0) != KVL_CUDA_SUCCESS) *dptr = 0;
	return KVL_CUDA_SUCCESS;
}
CUresult kvl_host_alloc(kvl_api *api, uintptr_t ctx, void **p, size_t n, int map, CUdeviceptr *dptr) {
	KVL_WITH_CTX(api, ctx, kvl_host_alloc_in_ctx(api, p, n, map && api->cuMemHostGetDevicePointer != NULL, dptr));
}
CUresult kvl_host_free(kvl_api *api, uintptr_t ctx, void *p) {
	KVL_WITH_CTX(api, ctx, api->cuMemFreeHost(p));
}
// kvl_stream_new and kvl_event_new create a stream or an event in the
// current context (the callers' KVL_WITH_CTX makes it so), storing it as
// a handle.
static CUresult kvl_stream_new(kvl_api *api, uintptr_t *s) {
	CUstream st = NULL;
	CUresult r = api->cuStreamCreate(&st, KVL_CU_STREAM_NON_BLOCKING);
	*s = (uintptr_t)st;
	return r;
}
static CUresult kvl_event_new(kvl_api *api, uintptr_t *e, unsigned int flags) {
	CUevent ev = NULL;
	CUresult r = api->cuEventCreate(&ev, flags);
	*e = (uintptr_t)ev;
	return r;
}
CUresult kvl_stream_create(kvl_api *api, uintptr_t ctx, uintptr_t *s) {
	KVL_WITH_CTX(api, ctx, kvl_stream_new(api, s));
}
CUresult kvl_stream_destroy(kvl_api *api, uintptr_t ctx, uintptr_t s) {
	KVL_WITH_CTX(api, ctx, api->cuStreamDestroy((CUstream)s));
}
// Events sleep in cuEventSynchronize (blocking sync) instead of spinning,
// and skip timing.
CUresult kvl_event_create(kvl_api *api, uintptr_t ctx, uintptr_t *e) {
	KVL_WITH_CTX(api, ctx, kvl_event_new(api, e, KVL_CU_EVENT_BLOCKING_SYNC | KVL_CU_EVENT_DISABLE_TIMING));
}
CUresult kvl_event_destroy(kvl_api *api, uintptr_t ctx, uintptr_t e) {
	KVL_WITH_CTX(api, ctx, api->cuEventDestroy((CUevent)e));
}
CUresult kvl_event_sync(kvl_api *api, uintptr_t ctx, uintptr_t e) {
	KVL_WITH_CTX(api, ctx, api->cuEventSynchronize((CUevent)e));
}
CUresult kvl_dtoh(kvl_api *api, uintptr_t ctx, void *dst, CUdeviceptr src, size_t n) {
	KVL_WITH_CTX(api, ctx, api->cuMemcpyDtoH(dst, src, n));
}
// A synchronous upload from pageable memory may return once the source is
// staged, before the DMA has landed, and the engine's non-blocking streams
// are not ordered after the legacy stream it ran on: synchronize that
// stream (NULL) before returning, so the bytes are in device memory when
// CopyFromHost returns.
CUresult kvl_htod(kvl_api *api, uintptr_t ctx, CUdeviceptr dst, const void *src, size_t n) {
	CUresult r = api->cuCtxPushCurrent((CUcontext)ctx);
	if (r != KVL_CUDA_SUCCESS) return r;
	r = api->cuMemcpyHtoD(dst, src, n);
	if (r == KVL_CUDA_SUCCESS) r = api->cuStreamSynchronize(NULL);
	CUcontext popped;
	api->cuCtxPopCurrent(&popped);
	return r;
}

int kvl_has_kernel(kvl_api *api) {
	return api->cuModuleLoadData && api->cuModuleGetFunction && api->cuLaunchKernel && api->cuModuleUnload;
}
int kvl_has_timing(kvl_api *api) { return api->cuEventElapsedTime != NULL; }
int kvl_has_map(kvl_api *api) { return api->cuMemHostGetDevicePointer != NULL; }

// kvl_module_load JIT-compiles the PTX image and finds entry. If the load
// fails and the driver has cuModuleLoadDataEx, it loads again asking for
// the JIT's error log, so the caller can say why.
CUresult kvl_module_load(kvl_api *api, uintptr_t ctx, const char *image, const char *entry, uintptr_t *mod,
                                uintptr_t *fn, char *log, size_t loglen) {
	log[0] = 0;
	CUresult r = api->cuCtxPushCurrent((CUcontext)ctx);
	if (r != KVL_CUDA_SUCCESS) return r;
	CUmodule m = NULL;
	CUfunction f = NULL;
	r = api->cuModuleLoadData(&m, image);
	if (r != KVL_CUDA_SUCCESS && api->cuModuleLoadDataEx != NULL) {
		int opts[2] = {KVL_CU_JIT_ERROR_LOG_BUFFER, KVL_CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
		void *vals[2] = {log, (void *)(uintptr_t)loglen};
		CUmodule m2 = NULL;
		if (api->cuModuleLoadDataEx(&m2, image, 2, opts, vals) == KVL_CUDA_SUCCESS && m2 != NULL) {
			api->cuModuleUnload(m2);
		}
		log[loglen - 1] = 0;
	}
	if (r == KVL_CUDA_SUCCESS) {
		r = api->cuModuleGetFunction(&f, m, entry);
		if (r != KVL_CUDA_SUCCESS) {
			api->cuModuleUnload(m);
			m = NULL;
		}
	}
	CUcontext popped;
	api->cuCtxPopCurrent(&popped);
	*mod = (uintptr_t)m;
	*fn = (uintptr_t)f;
	return r;
}
CUresult kvl_module_unload(kvl_api *api, uintptr_t ctx, uintptr_t mod) {
	KVL_WITH_CTX(api, ctx, api->cuModuleUnload((CUmodule)mod));
}

// Timing events (for benchmarks and the device check) keep timing on; they
// are never waited on, only measured.
CUresult kvl_event_create_timed(kvl_api *api, uintptr_t ctx, uintptr_t *e) {
	KVL_WITH_CTX(api, ctx, kvl_event_new(api, e, 0));
}
CUresult kvl_elapsed(kvl_api *api, uintptr_t ctx, uintptr_t start, uintptr_t end, float *ms) {
	KVL_WITH_CTX(api, ctx, api->cuEventElapsedTime(ms, (CUevent)start, (CUevent)end));
}
CUresult kvl_device_attr(kvl_api *api, CUdevice dev, int attr, int *v) {
	if (api->cuDeviceGetAttribute == NULL) return KVL_CUDA_ERROR_NOT_SUPPORTED;
	return api->cuDeviceGetAttribute(v, attr, dev);
}

static CUresult kvl_copy_one(kvl_api *api, int kind, CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
	switch (kind) {
	case KVL_HTOD:
		return api->cuMemcpyHtoDAsync(dst, (const void *)(uintptr_t)src, n, s);
	case KVL_DTOH:
		return api->cuMemcpyDtoHAsync((void *)(uintptr_t)dst, src, n, s);
	default:
		return api->cuMemcpyDtoDAsync(dst, src, n, s);
	}
}

// kvl_submit enqueues a submission on its stream and records its event
// after it, in one call so that the context stays current throughout. The
// copy kernel goes first when asked for; if its launch fails, the copy
// engine carries the copies instead. With useBatch and more than one copy
// it tries one cuMemcpyBatchAsync; if that fails it enqueues the copies
// one by one (copying a block twice from an unchanged source is
// harmless). If the event cannot be recorded it synchronizes the stream,
// so the caller learns whether anything can still be in flight. The copy
// arrays (Go memory) are read during the call only; nothing is allocated.
void kvl_submit(kvl_api *api, const kvl_submit_args *a, CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                       kvl_submit_result *res) {
	memset(res, 0, sizeof *res);
	CUstream s = (CUstream)a->stream;
	size_t n = a->n;
	CUresult r = api->cuCtxPushCurrent((CUcontext)a->ctx);
	if (r != KVL_CUDA_SUCCESS) {
		res->pushFailed = 1;
		res->enqueue = r;
		return;
	}
	if (a->start != 0 && a->end != 0) {
		res->timed = api->cuEventRecord((CUevent)a->start, s) == KVL_CUDA_SUCCESS;
	}
	int done = 0;
	if (a->fn != 0) {
		CUdeviceptr table = a->table;
		unsigned int ncta = a->ncta, nwarp = a->nwarp;
		void *params[3] = {&table, &ncta, &nwarp};
		r = api->cuLaunchKernel((CUfunction)a->fn, a->grid, 1, 1, a->threads, 1, 1, 0, s, params, NULL);
		if (r == KVL_CUDA_SUCCESS) {
			res->path = KVL_PATH_KERNEL;
			res->enqueued = n;
			done = 1;
		} else {
			res->kernelFailed = 1;
			res->kernelErr = r;
		}
	}
	if (!done && a->useBatch && n > 1 && api->cuMemcpyBatchAsync != NULL) {
		kvl_CUmemcpyAttributes attr;
		memset(&attr, 0, sizeof attr);
		attr.srcAccessOrder = KVL_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
		size_t attrIdx = 0, failIdx = SIZE_MAX;
		r = api->cuMemcpyBatchAsync(dsts, srcs, sizes, n, &attr, &attrIdx, 1, &failIdx, s);
		if (r == KVL_CUDA_SUCCESS) {
			res->path = KVL_PATH_BATCH;
			res->enqueued = n;
			done = 1;
		} else {
			res->batchFailed = 1;
			res->batchErr = r;
		}
	}
	if (!done) {
		res->path = KVL_PATH_LOOP;
		for (size_t i = 0; i < n; i++) {
			r = kvl_copy_one(api, a->kind, dsts[i], srcs[i], sizes[i], s);
			if (r != KVL_CUDA_SUCCESS) {
				res->enqueue = r;
				break;
			}
			res->enqueued++;
		}
	}
	if (res->timed) {
		res->timed = api->cuEventRecord((CUevent)a->end, s) == KVL_CUDA_SUCCESS;
	}
	res->record = api->cuEventRecord((CUevent)a->ev, s);
	if (res->record != KVL_CUDA_SUCCESS) {
		res->sync = api->cuStreamSynchronize(s);
	}
	CUcontext popped;
	api->cuCtxPopCurrent(&popped);
}
