// ucp_shims.h declares the C side of the UCX binding (ucp_shims.c): the
// completion state UCX's callbacks write (C memory the Go side reads on a
// worker's thread) and the shims through which ucp.go calls UCP (cgo
// cannot take a C callback's address or fill UCP's parameter structs
// tidily from Go).

#ifndef KVU_UCP_SHIMS_H
#define KVU_UCP_SHIMS_H

#include <stddef.h>
#include <stdint.h>
#include <ucp/api/ucp.h>

// kvu_batch counts the completions of a group of requests (one handoff's
// gets). It lives in C memory and is touched only on its worker's thread
// (callbacks run inside ucp_worker_progress).
typedef struct {
	int completed;
	int failed;
	ucs_status_t first;
} kvu_batch;

// kvu_op is one request whose completion we wait for (a flush).
typedef struct {
	int done;
	ucs_status_t status;
} kvu_op;

// kvu_ep is an endpoint's error state, set by UCX's error handler.
typedef struct {
	int failed;
	ucs_status_t status;
} kvu_ep;

// kvu_recv is one posted tagged receive (a block, or the integrity
// table): its request while outstanding, then its status and length. C
// memory, touched only on its worker's thread.
typedef struct {
	void *req;
	int done;
	ucs_status_t status;
	size_t length;
	kvu_batch *batch;
} kvu_recv;

int kvu_ep_failed(kvu_ep *e);
ucs_status_t kvu_init(ucp_context_h *ctx, int rma);
ucs_status_t kvu_worker(ucp_context_h ctx, ucp_worker_h *w, int *efd);
int kvu_eventfd(void);
void kvu_wake(int fd);
int kvu_progress(ucp_worker_h w);
void kvu_wait(ucp_worker_h w, int efd, int wakefd, int ms);
ucs_status_t kvu_ep_create(ucp_worker_h w, const void *addr, kvu_ep *e, ucp_ep_h *ep);
ucs_status_t kvu_ep_close(ucp_worker_h w, ucp_ep_h ep, int force);
ucs_status_t kvu_mem_map(ucp_context_h ctx, uintptr_t addr, size_t len, int cuda, ucp_mem_h *memh);
int kvu_get(ucp_ep_h ep, uintptr_t buf, size_t len, ucp_mem_h memh, uint64_t raddr, ucp_rkey_h rkey, kvu_batch *b, ucs_status_t *st);
ucs_status_t kvu_worker_flush(ucp_worker_h w, int spins);
int kvu_flush(ucp_ep_h ep, kvu_op *o, ucs_status_t *st);
int kvu_tag_recv(ucp_worker_h w, uintptr_t buf, size_t count, int iov, uint64_t tag, kvu_recv *r);
void kvu_recv_cancel(ucp_worker_h w, kvu_recv *r);
int kvu_tag_send(ucp_ep_h ep, uintptr_t buf, size_t count, int iov, uint64_t tag, kvu_batch *b, ucs_status_t *st);
void kvu_iov_set(ucp_dt_iov_t *v, size_t i, uintptr_t addr, size_t len);
void *kvu_ptr(uintptr_t a);

#endif
