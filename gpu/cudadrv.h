// cudadrv.h: the small part of the CUDA driver API that package gpu uses,
// written from the public documentation so that builds need no CUDA
// toolkit. Nothing here links against libcuda: driver_cgo.go loads
// libcuda.so.1 with dlopen at run time and fills a kvl_api table of function
// pointers; the kvl_* shims call through that table.
//
// Only the ABI matters: the types are the widths the driver uses on 64-bit
// Linux, and each function pointer has the signature of the versioned entry
// point we ask for (cuGetProcAddress with KVL_CUDA_VERSION, or dlsym of the
// _v2 names).

#ifndef KVLEASE_GPU_CUDADRV_H
#define KVLEASE_GPU_CUDADRV_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;

// The ABI version asked of cuGetProcAddress for every entry point but the
// batched copy: CUDA 12.0.
#define KVL_CUDA_VERSION 12000
// cuMemcpyBatchAsync appeared in 12.8; asking for 12.8 keeps its 12.x
// signature (with failIdx) even on a CUDA 13 driver, whose default
// cuMemcpyBatchAsync dropped that argument.
#define KVL_CUDA_VERSION_BATCH 12080

enum {
	KVL_CUDA_SUCCESS = 0,
	KVL_CUDA_ERROR_INVALID_VALUE = 1,
	KVL_CUDA_ERROR_NOT_SUPPORTED = 801,
	KVL_CUDA_ERROR_NOT_FOUND = 500,
	KVL_CUDA_ERROR_NOT_READY = 600,
};

enum {
	KVL_CU_STREAM_NON_BLOCKING = 0x1,
	KVL_CU_EVENT_BLOCKING_SYNC = 0x1,
	KVL_CU_EVENT_DISABLE_TIMING = 0x2,
	KVL_CU_MEMHOSTALLOC_PORTABLE = 0x1,
	KVL_CU_MEMHOSTALLOC_DEVICEMAP = 0x2,
	KVL_CU_GET_PROC_ADDRESS_DEFAULT = 0,
	KVL_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1,
	// CUjit_option values, for the JIT's error log.
	KVL_CU_JIT_ERROR_LOG_BUFFER = 5,
	KVL_CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6,
	// CUdevice_attribute values reported by the device check.
	KVL_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
	KVL_CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY = 19,
	KVL_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
	KVL_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
};

typedef struct {
	int type; // CUmemLocationType
	int id;
} kvl_CUmemLocation;

typedef struct {
	int srcAccessOrder; // CUmemcpySrcAccessOrder
	kvl_CUmemLocation srcLocHint;
	kvl_CUmemLocation dstLocHint;
	unsigned int flags;
} kvl_CUmemcpyAttributes;

typedef CUresult (*kvl_cuGetProcAddress_v2_t)(const char *symbol, void **pfn, int cudaVersion,
                                              uint64_t flags, int *symbolStatus);
typedef CUresult (*kvl_cuGetProcAddress_v1_t)(const char *symbol, void **pfn, int cudaVersion,
                                              uint64_t flags);

// kvl_api is the table of entry points. The order of the fields is the
// order of kvl_symbols in driver_cgo.go's preamble; optional entries come
// last.
typedef struct {
	CUresult (*cuInit)(unsigned int flags);
	CUresult (*cuDriverGetVersion)(int *version);
	CUresult (*cuGetErrorName)(CUresult err, const char **str);
	CUresult (*cuGetErrorString)(CUresult err, const char **str);
	CUresult (*cuDeviceGetCount)(int *count);
	CUresult (*cuDeviceGet)(CUdevice *dev, int ordinal);
	CUresult (*cuDeviceGetName)(char *name, int len, CUdevice dev);
	CUresult (*cuDeviceTotalMem)(size_t *bytes, CUdevice dev);
	CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *ctx, CUdevice dev);
	CUresult (*cuDevicePrimaryCtxRelease)(CUdevice dev);
	CUresult (*cuCtxPushCurrent)(CUcontext ctx);
	CUresult (*cuCtxPopCurrent)(CUcontext *ctx);
	CUresult (*cuMemGetInfo)(size_t *free, size_t *total);
	CUresult (*cuMemAlloc)(CUdeviceptr *dptr, size_t bytes);
	CUresult (*cuMemFree)(CUdeviceptr dptr);
	CUresult (*cuMemHostAlloc)(void **pp, size_t bytes, unsigned int flags);
	CUresult (*cuMemFreeHost)(void *p);
	CUresult (*cuStreamCreate)(CUstream *stream, unsigned int flags);
	CUresult (*cuStreamDestroy)(CUstream stream);
	CUresult (*cuStreamSynchronize)(CUstream stream);
	CUresult (*cuEventCreate)(CUevent *event, unsigned int flags);
	CUresult (*cuEventDestroy)(CUevent event);
	CUresult (*cuEventRecord)(CUevent event, CUstream stream);
	CUresult (*cuEventSynchronize)(CUevent event);
	CUresult (*cuEventQuery)(CUevent event);
	CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream);
	CUresult (*cuMemcpyDtoHAsync)(void *dst, CUdeviceptr src, size_t bytes, CUstream stream);
	CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream);
	CUresult (*cuMemcpyHtoD)(CUdeviceptr dst, const void *src, size_t bytes);
	CUresult (*cuMemcpyDtoH)(void *dst, CUdeviceptr src, size_t bytes);
	// Optional (CUDA 12.8+); NULL when the driver lacks it.
	CUresult (*cuMemcpyBatchAsync)(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
	                               kvl_CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
	                               size_t *failIdx, CUstream stream);
	// Optional: without them the gather kernel, GPU timing or the device
	// attributes are off; copies still work.
	CUresult (*cuModuleLoadData)(CUmodule *module, const void *image);
	CUresult (*cuModuleLoadDataEx)(CUmodule *module, const void *image, unsigned int numOptions, int *options,
	                               void **optionValues);
	CUresult (*cuModuleUnload)(CUmodule module);
	CUresult (*cuModuleGetFunction)(CUfunction *fn, CUmodule module, const char *name);
	CUresult (*cuLaunchKernel)(CUfunction fn, unsigned int gridX, unsigned int gridY, unsigned int gridZ,
	                           unsigned int blockX, unsigned int blockY, unsigned int blockZ,
	                           unsigned int sharedMemBytes, CUstream stream, void **kernelParams, void **extra);
	CUresult (*cuEventElapsedTime)(float *ms, CUevent start, CUevent end);
	CUresult (*cuDeviceGetAttribute)(int *value, int attribute, CUdevice dev);
	// Optional: without it pinned memory is not mapped and host↔device
	// copies never take the kernel.
	CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr *dptr, void *p, unsigned int flags);
} kvl_api;

// Copy directions of a submission (every copy of one has the same).
enum {
	KVL_HTOD = 0,
	KVL_DTOH = 1,
	KVL_DTOD = 2,
};

// How a submission was carried.
enum {
	KVL_PATH_LOOP = 0,
	KVL_PATH_BATCH = 1,
	KVL_PATH_KERNEL = 2,
};

// kvl_submit_args describes one submission. It holds no Go pointers (the
// copy arrays are passed beside it); host addresses are pinned driver
// memory (cuMemHostAlloc), never Go memory.
typedef struct {
	uintptr_t ctx, stream;
	uintptr_t ev;          // completion event, recorded after the copies
	uintptr_t start, end;  // timing events around the copies; 0 when untimed
	int kind;              // KVL_HTOD, KVL_DTOH or KVL_DTOD
	size_t n;              // number of copies
	int useBatch;          // try cuMemcpyBatchAsync first (n > 1)
	// The copy kernel, when fn != 0: launch fn(table, ncta, nwarp) with
	// grid CTAs of threads threads; the table (ncta + nwarp descriptors)
	// is already in mapped pinned memory at device address table. The
	// copy arrays are the copy engine's fallback if the launch fails.
	uintptr_t fn;
	CUdeviceptr table;
	unsigned int ncta, nwarp, grid, threads;
} kvl_submit_args;

// kvl_submit_result says how far a submission got.
typedef struct {
	int pushFailed;      // 1 when the context could not be made current: nothing enqueued
	CUresult enqueue;    // first error while enqueuing copies (0: all enqueued)
	CUresult record;     // cuEventRecord's result
	CUresult sync;       // cuStreamSynchronize's result, when record failed
	size_t enqueued;     // copies enqueued before the first error
	int path;            // KVL_PATH_*: what carried the copies
	int batchFailed;     // 1 when cuMemcpyBatchAsync failed and the loop ran instead
	CUresult batchErr;   // cuMemcpyBatchAsync's error in that case
	int kernelFailed;    // 1 when the launch failed and the copy engine ran instead
	CUresult kernelErr;  // its error in that case
	int timed;           // 1 when both timing events were recorded
} kvl_submit_result;

#endif
