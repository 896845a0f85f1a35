// fakecuda.c: a test double for libcuda.so.1, built by the cgo tests with
// gcc into a temporary shared library and loaded through the same dlopen
// path as the real driver. "Device" memory is host memory carved from one
// reserved range and packed like cuMemAlloc packs it. Streams are queues:
// copies, kernel launches and event records run in order when someone
// waits for an event recorded after them (cuEventSynchronize, or
// cuStreamSynchronize), never at enqueue time, so a table or a buffer the
// host changes between the launch and the wait shows. A synchronous
// pageable upload lands only when the legacy stream is synchronized (as
// the real one may).
//
// Pinned memory allocated with CU_MEMHOSTALLOC_DEVICEMAP is mapped twice:
// the host view cuMemHostAlloc returns and a device view at another
// address (cuMemHostGetDevicePointer), so a kernel handed a host address
// faults, as it would on a system where the two differ. The copy kernel
// (kvl_copy) runs on the host: it reads its descriptor table through the
// table's device address when the stream reaches the launch, and copies
// each item by device address; an address outside every live device
// allocation and device view, or a misaligned one, is a fault that loses
// the context (a sticky CUDA_ERROR_ILLEGAL_ADDRESS or MISALIGNED_ADDRESS).
//
// Build switches:
//   -DFAKE_NO_PROC_ADDRESS  export no cuGetProcAddress: resolution by dlsym of _v2 names
//   -DFAKE_NO_BATCH         no cuMemcpyBatchAsync (a pre-12.8 driver)
//   -DFAKE_NO_DEVICE        cuInit fails with CUDA_ERROR_NO_DEVICE
//   -DFAKE_MISSING_ALLOC    no cuMemAlloc_v2 (a driver too old to use)
//   -DFAKE_REJECT_PTX       cuModuleLoadData fails (a JIT that refuses the kernel)
//   -DFAKE_NO_MAP           no cuMemHostGetDevicePointer (pinned memory is never mapped)
//   -DFAKE_HOLD_FILE=path   while that file exists, nothing on any stream runs
//                           (event and stream waits block): a slow device
// Environment:
//   FAKECUDA_STICKY=<code>  the next cuEventSynchronize fails with <code>, and
//                           every call after it too (a sticky error)
//   FAKECUDA_LAUNCH_FAIL=<code>  cuLaunchKernel fails with <code>
//   FAKECUDA_HANG=1         cuEventSynchronize never returns (a hung device)

#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

static int sticky;
static int ctx_object;
static int ctx_depth;
static size_t used;
static const size_t total_mem = (size_t)4 << 30;

#define CHECK_STICKY() \
	do { \
		if (sticky) return sticky; \
	} while (0)

CUresult cuInit(unsigned int flags) {
	(void)flags;
#ifdef FAKE_NO_DEVICE
	return 100;
#else
	return 0;
#endif
}

CUresult cuDriverGetVersion(int *v) {
	*v = 12080;
	return 0;
}

CUresult cuGetErrorName(CUresult e, const char **s) {
	switch (e) {
	case 0: *s = "CUDA_SUCCESS"; return 0;
	case 2: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return 0;
	case 100: *s = "CUDA_ERROR_NO_DEVICE"; return 0;
	case 700: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; return 0;
	}
	*s = NULL;
	return 1; // unknown to the fake: the caller falls back to its own table
}

CUresult cuGetErrorString(CUresult e, const char **s) {
	switch (e) {
	case 0: *s = "no error"; return 0;
	case 2: *s = "out of memory (fake)"; return 0;
	case 100: *s = "no CUDA-capable device is detected (fake)"; return 0;
	case 700: *s = "an illegal memory access was encountered (fake)"; return 0;
	}
	*s = NULL;
	return 1;
}

CUresult cuDeviceGetCount(int *n) {
	*n = 1;
	return 0;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
	if (ordinal != 0) return 101;
	*d = 0;
	return 0;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
	(void)d;
	snprintf(name, (size_t)len, "Fake CUDA Device");
	return 0;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
	(void)d;
	*bytes = total_mem;
	return 0;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) {
	(void)d;
	*ctx = &ctx_object;
	return 0;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
	(void)d;
	return 0;
}

CUresult cuCtxPushCurrent_v2(void *ctx) {
	if (ctx != &ctx_object) return 201;
	__atomic_add_fetch(&ctx_depth, 1, __ATOMIC_SEQ_CST);
	return 0;
}

CUresult cuCtxPopCurrent_v2(void **ctx) {
	__atomic_sub_fetch(&ctx_depth, 1, __ATOMIC_SEQ_CST);
	*ctx = &ctx_object;
	return 0;
}

CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) {
	CHECK_STICKY();
	*total = total_mem;
	*free_ = total_mem - __atomic_load_n(&used, __ATOMIC_SEQ_CST);
	return 0;
}

// Device memory is one reserved range of address space, carved like the
// real cuMemAlloc carves it: small allocations are packed at 512-byte
// granularity, first fit, so the byte one past an allocation is very
// likely the first byte of the next one. Tests that assume a gap between
// arenas fail here as they would on a GPU.
#define FAKE_GRAIN 512
#define FAKE_MAX_ALLOCS 4096

struct fake_alloc {
	size_t off, n; // offset in the range, requested size
};

static char *dev_base;                             // the reserved range, total_mem bytes
static struct fake_alloc allocs[FAKE_MAX_ALLOCS]; // live allocations, by offset
static int nallocs;
static char alloc_lock;

static void lock(void) {
	while (__atomic_test_and_set(&alloc_lock, __ATOMIC_ACQUIRE)) {
	}
}
static void unlock(void) { __atomic_clear(&alloc_lock, __ATOMIC_RELEASE); }

static size_t grain(size_t n) { return (n + FAKE_GRAIN - 1) / FAKE_GRAIN * FAKE_GRAIN; }

#ifndef FAKE_MISSING_ALLOC
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
	CHECK_STICKY();
	if (n == 0) return 1;
	if (n > total_mem - __atomic_load_n(&used, __ATOMIC_SEQ_CST)) return 2;
	lock();
	if (dev_base == NULL) {
		void *m = mmap(NULL, total_mem, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
		if (m == MAP_FAILED) {
			unlock();
			return 2;
		}
		dev_base = m;
	}
	size_t need = grain(n), at = 0;
	int i = 0;
	for (; i < nallocs; i++) {
		if (allocs[i].off - at >= need) break;
		at = allocs[i].off + grain(allocs[i].n);
	}
	if (nallocs == FAKE_MAX_ALLOCS || total_mem - at < need) {
		unlock();
		return 2;
	}
	memmove(&allocs[i + 1], &allocs[i], (size_t)(nallocs - i) * sizeof allocs[0]);
	allocs[i].off = at;
	allocs[i].n = n;
	nallocs++;
	unlock();
	__atomic_add_fetch(&used, need, __ATOMIC_SEQ_CST);
	*p = (CUdeviceptr)(uintptr_t)(dev_base + at);
	return 0;
}
#endif

static void flush_legacy(void);

// cuMemFree synchronizes like the real one (pending uploads land first)
// and returns whole pages to the system.
CUresult cuMemFree_v2(CUdeviceptr p) {
	CHECK_STICKY();
	flush_legacy();
	lock();
	int i = 0;
	for (; i < nallocs; i++) {
		if ((uintptr_t)(dev_base + allocs[i].off) == p) break;
	}
	if (dev_base == NULL || i == nallocs) {
		unlock();
		return 1; // not an allocation's base
	}
	size_t off = allocs[i].off, need = grain(allocs[i].n);
	memmove(&allocs[i], &allocs[i + 1], (size_t)(nallocs - i - 1) * sizeof allocs[0]);
	nallocs--;
	unlock();
	size_t lo = (off + 4095) / 4096 * 4096, hi = (off + need) / 4096 * 4096;
	if (hi > lo) madvise(dev_base + lo, hi - lo, MADV_DONTNEED);
	__atomic_sub_fetch(&used, need, __ATOMIC_SEQ_CST);
	return 0;
}

// dev_contains reports whether [p, p+n) lies in one live device
// allocation.
static int dev_contains(uintptr_t p, size_t n) {
	int ok = 0;
	lock();
	for (int i = 0; dev_base != NULL && i < nallocs; i++) {
		uintptr_t lo = (uintptr_t)(dev_base + allocs[i].off);
		if (p >= lo && p - lo <= allocs[i].n && n <= allocs[i].n - (p - lo)) {
			ok = 1;
			break;
		}
	}
	unlock();
	return ok;
}

// Pinned memory. Mapped allocations (CU_MEMHOSTALLOC_DEVICEMAP) are one
// memfd mapped twice: the host view and the device view.
#define FAKE_MAX_MAPS 1024

struct mapped {
	char *host, *dev;
	size_t n; // mapped length (whole pages)
};

static struct mapped maps[FAKE_MAX_MAPS];
static int nmaps;
static pthread_mutex_t maps_mu = PTHREAD_MUTEX_INITIALIZER;

CUresult cuMemHostAlloc(void **pp, size_t n, unsigned int flags) {
	CHECK_STICKY();
	size_t size = ((n ? n : 1) + 4095) / 4096 * 4096;
	if (!(flags & 0x2)) {
		*pp = aligned_alloc(4096, size);
		return *pp ? 0 : 2;
	}
	int fd = memfd_create("fakecuda-pinned", MFD_CLOEXEC);
	if (fd < 0) return 2;
	if (ftruncate(fd, (off_t)size) != 0) {
		close(fd);
		return 2;
	}
	char *host = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	char *dev = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (host == MAP_FAILED || dev == MAP_FAILED) {
		if (host != MAP_FAILED) munmap(host, size);
		if (dev != MAP_FAILED) munmap(dev, size);
		return 2;
	}
	pthread_mutex_lock(&maps_mu);
	if (nmaps == FAKE_MAX_MAPS) {
		pthread_mutex_unlock(&maps_mu);
		munmap(host, size);
		munmap(dev, size);
		return 2;
	}
	maps[nmaps++] = (struct mapped){host, dev, size};
	pthread_mutex_unlock(&maps_mu);
	*pp = host;
	return 0;
}

CUresult cuMemFreeHost(void *p) {
	pthread_mutex_lock(&maps_mu);
	for (int i = 0; i < nmaps; i++) {
		if (maps[i].host == p) {
			struct mapped m = maps[i];
			maps[i] = maps[--nmaps];
			pthread_mutex_unlock(&maps_mu);
			munmap(m.host, m.n);
			munmap(m.dev, m.n);
			return 0;
		}
	}
	pthread_mutex_unlock(&maps_mu);
	free(p);
	return 0;
}

#ifndef FAKE_NO_MAP
// cuMemHostGetDevicePointer returns the device view of a host address of
// a mapped allocation; anything else is CUDA_ERROR_INVALID_VALUE.
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned int flags) {
	CHECK_STICKY();
	if (flags != 0) return 1;
	pthread_mutex_lock(&maps_mu);
	for (int i = 0; i < nmaps; i++) {
		if ((char *)p >= maps[i].host && (char *)p < maps[i].host + maps[i].n) {
			*d = (CUdeviceptr)(uintptr_t)(maps[i].dev + ((char *)p - maps[i].host));
			pthread_mutex_unlock(&maps_mu);
			return 0;
		}
	}
	pthread_mutex_unlock(&maps_mu);
	return 1;
}
#endif

// map_contains reports whether [p, p+n) lies in one device view.
static int map_contains(uintptr_t p, size_t n) {
	int ok = 0;
	pthread_mutex_lock(&maps_mu);
	for (int i = 0; i < nmaps; i++) {
		uintptr_t lo = (uintptr_t)maps[i].dev;
		if (p >= lo && p - lo <= maps[i].n && n <= maps[i].n - (p - lo)) {
			ok = 1;
			break;
		}
	}
	pthread_mutex_unlock(&maps_mu);
	return ok;
}

// device_reachable: what a kernel may touch.
static int device_reachable(uint64_t p, uint64_t n) { return dev_contains((uintptr_t)p, n) || map_contains((uintptr_t)p, n); }

// Streams: a queue of operations run in order by whoever waits.
enum { OP_COPY, OP_KERNEL, OP_RECORD };

struct fake_event;

struct op {
	int kind;
	struct op *next;
	void *dst;
	const void *src;
	size_t n;                 // OP_COPY
	uint64_t table;           // OP_KERNEL
	unsigned int ncta, nwarp; // OP_KERNEL
	struct fake_event *ev;    // OP_RECORD
	unsigned long long seq;   // OP_RECORD
};

struct fake_stream {
	pthread_mutex_t mu;
	struct op *head, **tail;
	unsigned long long recorded; // records enqueued
};

// An event remembers the stream and sequence number of its last record,
// and when that record ran, for cuEventElapsedTime.
struct fake_event {
	unsigned int flags;
	struct timespec at;
	struct fake_stream *s;
	unsigned long long seq;
	int recorded, done;
};

int fake_kernel_items; // items the kernel copied, for tests

// run_kernel executes one launch of kvl_copy as the PTX does: the table
// read now, through its device address.
static CUresult run_kernel(const struct op *o) {
	uint64_t count = (uint64_t)o->ncta + o->nwarp;
	if (o->table % 16 || !device_reachable(o->table, count * 32)) return 700;
	const uint64_t *t = (const uint64_t *)(uintptr_t)o->table;
	for (uint64_t i = 0; i < count; i++) {
		uint64_t src = t[4 * i], dst = t[4 * i + 1], n = t[4 * i + 2];
		if (n == 0 || n % 16 || src % 16 || dst % 16) return 716; // the vector loads would fault
		if (i < o->ncta ? n > (64 << 10) : n > (8 << 10)) return 716;
		if (!device_reachable(src, n) || !device_reachable(dst, n)) return 700;
		memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
		__atomic_add_fetch(&fake_kernel_items, 1, __ATOMIC_SEQ_CST);
	}
	return 0;
}

// drain runs s's operations until ev's record has run (ev NULL: all).
// Called with s->mu held. A fault makes the context sticky; nothing runs
// after it.
static void drain(struct fake_stream *s, struct fake_event *ev) {
	while (s->head != NULL && !(ev != NULL && ev->done)) {
		struct op *o = s->head;
		s->head = o->next;
		if (s->head == NULL) s->tail = &s->head;
		if (!sticky) {
			switch (o->kind) {
			case OP_COPY:
				memcpy(o->dst, o->src, o->n);
				break;
			case OP_KERNEL: {
				CUresult r = run_kernel(o);
				if (r != 0) sticky = r;
				break;
			}
			}
		}
		if (o->kind == OP_RECORD && o->ev->s == s && o->ev->seq == o->seq) {
			clock_gettime(CLOCK_MONOTONIC, &o->ev->at);
			o->ev->done = 1;
		}
		free(o);
	}
}

static CUresult enqueue(struct fake_stream *s, struct op *o) {
	if (o == NULL) return 2;
	o->next = NULL;
	pthread_mutex_lock(&s->mu);
	*s->tail = o;
	s->tail = &o->next;
	pthread_mutex_unlock(&s->mu);
	return 0;
}

static CUresult enqueue_copy(void *s, void *dst, const void *src, size_t n) {
	struct op *o = calloc(1, sizeof *o);
	if (o == NULL) return 2;
	o->kind = OP_COPY;
	o->dst = dst;
	o->src = src;
	o->n = n;
	return enqueue(s, o);
}

static void hold(void) {
#ifdef FAKE_HOLD_FILE
	struct timespec d = {0, 100 * 1000};
	while (access(FAKE_HOLD_FILE, F_OK) == 0) nanosleep(&d, NULL);
#endif
}

CUresult cuStreamCreate(void **s, unsigned int flags) {
	(void)flags;
	CHECK_STICKY();
	struct fake_stream *st = calloc(1, sizeof *st);
	if (st == NULL) return 2;
	pthread_mutex_init(&st->mu, NULL);
	st->tail = &st->head;
	*s = st;
	return 0;
}

// cuStreamDestroy returns at once on a real driver and the work still
// completes: the fake runs it now.
CUresult cuStreamDestroy_v2(void *s) {
	struct fake_stream *st = s;
	pthread_mutex_lock(&st->mu);
	drain(st, NULL);
	pthread_mutex_unlock(&st->mu);
	pthread_mutex_destroy(&st->mu);
	free(st);
	return 0;
}

CUresult cuStreamSynchronize(void *s) {
	CHECK_STICKY();
	if (s == NULL) {
		flush_legacy(); // the legacy default stream
		return 0;
	}
	hold();
	struct fake_stream *st = s;
	pthread_mutex_lock(&st->mu);
	drain(st, NULL);
	pthread_mutex_unlock(&st->mu);
	CHECK_STICKY();
	return 0;
}

CUresult cuEventCreate(void **e, unsigned int flags) {
	CHECK_STICKY();
	struct fake_event *ev = calloc(1, sizeof *ev);
	if (ev == NULL) return 2;
	ev->flags = flags;
	*e = ev;
	return 0;
}

CUresult cuEventDestroy_v2(void *e) {
	free(e);
	return 0;
}

CUresult cuEventRecord(void *e, void *s) {
	CHECK_STICKY();
	struct fake_event *ev = e;
	struct fake_stream *st = s;
	if (st == NULL) return 1; // the engine never records on the legacy stream
	struct op *o = calloc(1, sizeof *o);
	if (o == NULL) return 2;
	o->kind = OP_RECORD;
	o->ev = ev;
	o->next = NULL;
	pthread_mutex_lock(&st->mu);
	o->seq = ++st->recorded;
	ev->s = st;
	ev->seq = o->seq;
	ev->recorded = 1;
	ev->done = 0;
	*st->tail = o;
	st->tail = &o->next;
	pthread_mutex_unlock(&st->mu);
	return 0;
}

// cuEventElapsedTime refuses events created without timing (flag 0x2) or
// whose records have not run, as the real one does.
CUresult cuEventElapsedTime(float *ms, void *start, void *end) {
	CHECK_STICKY();
	struct fake_event *a = start, *b = end;
	if ((a->flags & 0x2) || (b->flags & 0x2)) return 400;
	if (!a->recorded || !b->recorded || !a->done || !b->done) return 600;
	*ms = (float)((double)(b->at.tv_sec - a->at.tv_sec) * 1e3 + (double)(b->at.tv_nsec - a->at.tv_nsec) / 1e6);
	return 0;
}

CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
	(void)d;
	switch (attr) {
	case 16: *v = 132; return 0; // multiprocessors
	case 19: *v = 1; return 0;   // can map host memory
	case 75: *v = 9; return 0;   // compute capability 9.0
	case 76: *v = 0; return 0;
	}
	return 1;
}

CUresult cuEventSynchronize(void *e) {
	const char *hang = getenv("FAKECUDA_HANG");
	if (hang && *hang) {
		for (;;) pause(); // a device that never answers (devicecheck.sh's hang drill)
	}
	hold();
	struct fake_event *ev = e;
	if (ev->recorded && ev->s != NULL) {
		pthread_mutex_lock(&ev->s->mu);
		drain(ev->s, ev);
		pthread_mutex_unlock(&ev->s->mu);
	}
	const char *v = getenv("FAKECUDA_STICKY");
	if (v && *v) sticky = atoi(v);
	CHECK_STICKY();
	return 0;
}

CUresult cuEventQuery(void *e) {
	CHECK_STICKY();
	struct fake_event *ev = e;
	return !ev->recorded || ev->done ? 0 : 600;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *s) {
	CHECK_STICKY();
	return enqueue_copy(s, (void *)(uintptr_t)dst, src, n);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *s) {
	CHECK_STICKY();
	return enqueue_copy(s, dst, (const void *)(uintptr_t)src, n);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *s) {
	CHECK_STICKY();
	return enqueue_copy(s, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
}

// A pageable upload returns once the source is staged, before the "DMA"
// lands, as the real cuMemcpyHtoD may: the bytes reach device memory only
// when the legacy stream is synchronized (cuStreamSynchronize(NULL),
// cuCtxSynchronize, cuMemFree) or its next synchronous copy runs. Copies on
// non-blocking streams are not ordered after it, so they see old bytes.
struct staged {
	CUdeviceptr dst;
	void *buf;
	size_t n;
	struct staged *next;
};
static struct staged *staged_head, **staged_tail = &staged_head;
static char staged_lock;

static void flush_legacy(void) {
	while (__atomic_test_and_set(&staged_lock, __ATOMIC_ACQUIRE)) {
	}
	struct staged *s = staged_head;
	staged_head = NULL;
	staged_tail = &staged_head;
	__atomic_clear(&staged_lock, __ATOMIC_RELEASE);
	while (s) {
		struct staged *next = s->next;
		memcpy((void *)(uintptr_t)s->dst, s->buf, s->n);
		free(s->buf);
		free(s);
		s = next;
	}
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
	CHECK_STICKY();
	flush_legacy();
	struct staged *s = malloc(sizeof *s);
	if (s == NULL) return 2;
	s->buf = malloc(n ? n : 1);
	if (s->buf == NULL) {
		free(s);
		return 2;
	}
	memcpy(s->buf, src, n);
	s->dst = dst;
	s->n = n;
	s->next = NULL;
	while (__atomic_test_and_set(&staged_lock, __ATOMIC_ACQUIRE)) {
	}
	*staged_tail = s;
	staged_tail = &s->next;
	__atomic_clear(&staged_lock, __ATOMIC_RELEASE);
	return 0;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
	CHECK_STICKY();
	flush_legacy();
	memcpy(dst, (const void *)(uintptr_t)src, n);
	return 0;
}

CUresult cuCtxSynchronize(void) {
	CHECK_STICKY();
	flush_legacy();
	return 0;
}

// The module API, with run_kernel as the kernel. cuModuleLoadData checks
// the PTX as far as a fake can: a NUL-terminated text with a .version, an
// sm_ .target no newer than sm_90 (so the real JIT accepts it on Hopper and
// older), 64-bit addresses, and the entry kvl_copy with exactly three
// parameters, a .u64 and two .u32. FAKE_REJECT_PTX makes the load fail
// with CUDA_ERROR_INVALID_PTX (218) and a JIT log.
// FAKECUDA_LAUNCH_FAIL=<code> makes cuLaunchKernel fail with <code>.
static int module_object, function_object;
int fake_modules_loaded; // live modules, for tests

static int ptx_ok(const char *ptx) {
	if (ptx == NULL || strnlen(ptx, 1 << 20) == 1 << 20) return 0;
	const char *t = strstr(ptx, ".target sm_");
	if (strstr(ptx, ".version ") == NULL || t == NULL || strstr(ptx, ".address_size 64") == NULL) return 0;
	if (atoi(t + strlen(".target sm_")) > 90) return 0;
	const char *e = strstr(ptx, ".entry kvl_copy(");
	if (e == NULL) return 0;
	const char *close = strchr(e, ')');
	if (close == NULL) return 0;
	int params = 0;
	const char *kinds[3] = {".param .u64 ", ".param .u32 ", ".param .u32 "};
	for (const char *p = strstr(e, ".param"); p != NULL && p < close; p = strstr(p + 1, ".param")) {
		if (params < 3 && strncmp(p, kinds[params], strlen(kinds[params])) != 0) return 0;
		params++;
	}
	return params == 3;
}

CUresult cuModuleLoadData(void **mod, const void *image) {
	CHECK_STICKY();
#ifdef FAKE_REJECT_PTX
	(void)mod;
	(void)image;
	return 218;
#else
	if (!ptx_ok(image)) return 218;
	*mod = &module_object;
	__atomic_add_fetch(&fake_modules_loaded, 1, __ATOMIC_SEQ_CST);
	return 0;
#endif
}

CUresult cuModuleLoadDataEx(void **mod, const void *image, unsigned int n, int *opts, void **vals) {
	CUresult r = cuModuleLoadData(mod, image);
	if (r == 0) return 0;
	char *log = NULL;
	size_t len = 0;
	for (unsigned int i = 0; i < n; i++) {
		if (opts[i] == 5) log = vals[i];
		if (opts[i] == 6) len = (size_t)(uintptr_t)vals[i];
	}
	if (log && len) snprintf(log, len, "fake ptxas: the PTX was rejected");
	return r;
}

CUresult cuModuleUnload(void *mod) {
	if (mod != &module_object) return 400;
	__atomic_sub_fetch(&fake_modules_loaded, 1, __ATOMIC_SEQ_CST);
	return 0;
}

CUresult cuModuleGetFunction(void **fn, void *mod, const char *name) {
	CHECK_STICKY();
	if (mod != &module_object) return 400;
	if (strcmp(name, "kvl_copy") != 0) return 500;
	*fn = &function_object;
	return 0;
}

// cuLaunchKernel checks the launch as the driver would (a one-dimensional
// grid, 32 to 256 threads per CTA as the PTX's .maxntid allows, no shared
// memory, parameters by pointer) and queues it; the parameters are
// copied now, as the driver copies them.
CUresult cuLaunchKernel(void *fn, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
                        unsigned int bz, unsigned int shmem, void *s, void **params, void **extra) {
	CHECK_STICKY();
	const char *v = getenv("FAKECUDA_LAUNCH_FAIL");
	if (v && *v) return atoi(v);
	if (fn != &function_object || params == NULL || extra != NULL || s == NULL) return 1;
	if (gx == 0 || gx > 65535 || gy != 1 || gz != 1 || by != 1 || bz != 1 || shmem != 0) return 1;
	if (bx == 0 || bx > 256 || bx % 32 != 0) return 701; // more threads than .maxntid: out of resources
	struct op *o = calloc(1, sizeof *o);
	if (o == NULL) return 2;
	o->kind = OP_KERNEL;
	o->table = *(CUdeviceptr *)params[0];
	o->ncta = *(unsigned int *)params[1];
	o->nwarp = *(unsigned int *)params[2];
	return enqueue(s, o);
}

#ifndef FAKE_NO_BATCH
typedef struct {
	int srcAccessOrder;
	int srcLoc[2];
	int dstLoc[2];
	unsigned int flags;
} attrs_t;

// The 12.8 signature, with failIdx.
CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, attrs_t *attrs,
                            size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, void *s) {
	CHECK_STICKY();
	if (numAttrs != 1 || attrsIdxs[0] != 0 || attrs[0].srcAccessOrder != 1) {
		*failIdx = 0;
		return 1;
	}
	for (size_t i = 0; i < count; i++) {
		CUresult r = enqueue_copy(s, (void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i], sizes[i]);
		if (r != 0) return r;
	}
	return 0;
}
#endif

#ifndef FAKE_NO_PROC_ADDRESS
struct entry {
	const char *name;
	void *fn;
	int since;
};

#define E(n, f) {n, (void *)f, 0}
static const struct entry entries[] = {
	E("cuInit", cuInit),
	E("cuDriverGetVersion", cuDriverGetVersion),
	E("cuGetErrorName", cuGetErrorName),
	E("cuGetErrorString", cuGetErrorString),
	E("cuDeviceGetCount", cuDeviceGetCount),
	E("cuDeviceGet", cuDeviceGet),
	E("cuDeviceGetName", cuDeviceGetName),
	E("cuDeviceTotalMem", cuDeviceTotalMem_v2),
	E("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain),
	E("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease_v2),
	E("cuCtxPushCurrent", cuCtxPushCurrent_v2),
	E("cuCtxPopCurrent", cuCtxPopCurrent_v2),
	E("cuMemGetInfo", cuMemGetInfo_v2),
#ifndef FAKE_MISSING_ALLOC
	E("cuMemAlloc", cuMemAlloc_v2),
#endif
	E("cuMemFree", cuMemFree_v2),
	E("cuMemHostAlloc", cuMemHostAlloc),
	E("cuMemFreeHost", cuMemFreeHost),
	E("cuStreamCreate", cuStreamCreate),
	E("cuStreamDestroy", cuStreamDestroy_v2),
	E("cuStreamSynchronize", cuStreamSynchronize),
	E("cuEventCreate", cuEventCreate),
	E("cuEventDestroy", cuEventDestroy_v2),
	E("cuEventRecord", cuEventRecord),
	E("cuEventSynchronize", cuEventSynchronize),
	E("cuEventQuery", cuEventQuery),
	E("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync_v2),
	E("cuMemcpyDtoHAsync", cuMemcpyDtoHAsync_v2),
	E("cuMemcpyDtoDAsync", cuMemcpyDtoDAsync_v2),
	E("cuMemcpyHtoD", cuMemcpyHtoD_v2),
	E("cuMemcpyDtoH", cuMemcpyDtoH_v2),
	E("cuModuleLoadData", cuModuleLoadData),
	E("cuModuleLoadDataEx", cuModuleLoadDataEx),
	E("cuModuleUnload", cuModuleUnload),
	E("cuModuleGetFunction", cuModuleGetFunction),
	E("cuLaunchKernel", cuLaunchKernel),
	E("cuEventElapsedTime", cuEventElapsedTime),
	E("cuDeviceGetAttribute", cuDeviceGetAttribute),
#ifndef FAKE_NO_MAP
	E("cuMemHostGetDevicePointer", cuMemHostGetDevicePointer_v2),
#endif
#ifndef FAKE_NO_BATCH
	{"cuMemcpyBatchAsync", (void *)cuMemcpyBatchAsync, 12080},
#endif
};

// cuGetProcAddress_v2 answers from the table; asking with a version older
// than an entry point's first version is "version not sufficient" (2).
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
	(void)flags;
	*pfn = NULL;
	for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
		if (strcmp(entries[i].name, symbol) == 0) {
			if (version < entries[i].since) {
				if (status) *status = 2;
				return 500;
			}
			*pfn = entries[i].fn;
			if (status) *status = 0;
			return 0;
		}
	}
	if (status) *status = 1;
	return 500;
}
#endif
