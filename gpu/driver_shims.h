// driver_shims.h declares the C shims of driver_cgo.c, through which the
// Go side (driver_cgo.go) calls the CUDA driver: cgo cannot call a C
// function pointer. The types are cudadrv.h's.

#ifndef KVL_DRIVER_SHIMS_H
#define KVL_DRIVER_SHIMS_H

#include <stddef.h>
#include <stdint.h>
#include "cudadrv.h"

int kvl_load(const char *path, kvl_api *api, uintptr_t *handle, int *resolver, char *msg, size_t msglen);
int kvl_has_batch(kvl_api *api);
CUresult kvl_init(kvl_api *api, int *version);
void kvl_error_strings(kvl_api *api, CUresult code, const char **name, const char **str);
CUresult kvl_device_count(kvl_api *api, int *n);
CUresult kvl_device_get(kvl_api *api, CUdevice *dev, int ordinal);
CUresult kvl_device_name(kvl_api *api, char *name, int len, CUdevice dev);
CUresult kvl_device_total(kvl_api *api, size_t *bytes, CUdevice dev);
CUresult kvl_ctx_retain(kvl_api *api, CUdevice dev, uintptr_t *ctx);
CUresult kvl_ctx_release(kvl_api *api, CUdevice dev);
CUresult kvl_mem_get_info(kvl_api *api, uintptr_t ctx, size_t *free_, size_t *total);
CUresult kvl_mem_alloc(kvl_api *api, uintptr_t ctx, CUdeviceptr *p, size_t n);
CUresult kvl_mem_free(kvl_api *api, uintptr_t ctx, CUdeviceptr p);
CUresult kvl_host_alloc(kvl_api *api, uintptr_t ctx, void **p, size_t n, int map, CUdeviceptr *dptr);
CUresult kvl_host_free(kvl_api *api, uintptr_t ctx, void *p);
CUresult kvl_stream_create(kvl_api *api, uintptr_t ctx, uintptr_t *s);
CUresult kvl_stream_destroy(kvl_api *api, uintptr_t ctx, uintptr_t s);
CUresult kvl_event_create(kvl_api *api, uintptr_t ctx, uintptr_t *e);
CUresult kvl_event_destroy(kvl_api *api, uintptr_t ctx, uintptr_t e);
CUresult kvl_event_sync(kvl_api *api, uintptr_t ctx, uintptr_t e);
CUresult kvl_dtoh(kvl_api *api, uintptr_t ctx, void *dst, CUdeviceptr src, size_t n);
CUresult kvl_htod(kvl_api *api, uintptr_t ctx, CUdeviceptr dst, const void *src, size_t n);
int kvl_has_kernel(kvl_api *api);
int kvl_has_timing(kvl_api *api);
int kvl_has_map(kvl_api *api);
CUresult kvl_module_load(kvl_api *api, uintptr_t ctx, const char *image, const char *entry, uintptr_t *mod, uintptr_t *fn, char *log, size_t loglen);
CUresult kvl_module_unload(kvl_api *api, uintptr_t ctx, uintptr_t mod);
CUresult kvl_event_create_timed(kvl_api *api, uintptr_t ctx, uintptr_t *e);
CUresult kvl_elapsed(kvl_api *api, uintptr_t ctx, uintptr_t start, uintptr_t end, float *ms);
CUresult kvl_device_attr(kvl_api *api, CUdevice dev, int attr, int *v);
void kvl_submit(kvl_api *api, const kvl_submit_args *a, CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, kvl_submit_result *res);

#endif
