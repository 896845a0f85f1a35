// The C side of the UCX binding (ucp.go): the completion callbacks UCX
// calls inside ucp_worker_progress and the shims Go calls UCP through.
// Declared in ucp_shims.h.

#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <ucp/api/ucp.h>
#include "ucp_shims.h"

// kvu_batch_done counts one completion of b's requests with status st.
static void kvu_batch_done(kvu_batch *b, ucs_status_t st) {
	b->completed++;
	if (st != UCS_OK) {
		if (b->failed == 0) b->first = st;
		b->failed++;
	}
}

static void kvu_batch_cb(void *req, ucs_status_t st, void *user) {
	kvu_batch_done((kvu_batch *)user, st);
	ucp_request_free(req);
}

static void kvu_op_cb(void *req, ucs_status_t st, void *user) {
	kvu_op *o = (kvu_op *)user;
	o->status = st;
	o->done = 1;
	ucp_request_free(req);
}

static void kvu_ep_err(void *arg, ucp_ep_h ep, ucs_status_t st) {
	kvu_ep *e = (kvu_ep *)arg;
	if (!__atomic_load_n(&e->failed, __ATOMIC_RELAXED)) e->status = st;
	__atomic_store_n(&e->failed, 1, __ATOMIC_RELEASE);
}

// kvu_ep_failed reads e's failure flag from any thread (the handler
// publishes the status before the flag).
int kvu_ep_failed(kvu_ep *e) { return __atomic_load_n(&e->failed, __ATOMIC_ACQUIRE); }

// kvu_init creates a context: with remote memory access (rma: the pull
// model) or with tagged messages only (the push model: no RMA feature, so
// no worker of it serves UCP's software-emulated gets or puts).
ucs_status_t kvu_init(ucp_context_h *ctx, int rma) {
	ucp_config_t *cfg;
	ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
	if (st != UCS_OK) return st;
	ucp_params_t p;
	memset(&p, 0, sizeof p);
	p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
	p.features = (rma ? UCP_FEATURE_RMA : UCP_FEATURE_TAG) | UCP_FEATURE_WAKEUP;
	p.mt_workers_shared = 1;
	st = ucp_init(&p, cfg, ctx);
	ucp_config_release(cfg);
	return st;
}

ucs_status_t kvu_worker(ucp_context_h ctx, ucp_worker_h *w, int *efd) {
	ucp_worker_params_t p;
	memset(&p, 0, sizeof p);
	p.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
	p.thread_mode = UCS_THREAD_MODE_SINGLE;
	ucs_status_t st = ucp_worker_create(ctx, &p, w);
	if (st != UCS_OK) return st;
	st = ucp_worker_get_efd(*w, efd);
	if (st != UCS_OK) ucp_worker_destroy(*w);
	return st;
}

int kvu_eventfd(void) { return eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC); }

void kvu_wake(int fd) {
	uint64_t one = 1;
	ssize_t n = write(fd, &one, sizeof one);
	(void)n;
}

// kvu_progress progresses w until it has nothing more to do (bounded).
int kvu_progress(ucp_worker_h w) {
	int total = 0;
	for (int i = 0; i < 1024; i++) {
		unsigned n = ucp_worker_progress(w);
		if (n == 0) break;
		total += n;
	}
	return total;
}

// kvu_wait arms w and waits up to ms for its event fd or our wake fd.
void kvu_wait(ucp_worker_h w, int efd, int wakefd, int ms) {
	if (ucp_worker_arm(w) == UCS_ERR_BUSY) return;
	struct pollfd f[2] = {{efd, POLLIN, 0}, {wakefd, POLLIN, 0}};
	int n = poll(f, 2, ms);
	if (n > 0 && (f[1].revents & POLLIN)) {
		uint64_t v;
		ssize_t r = read(wakefd, &v, sizeof v);
		(void)r;
	}
}

ucs_status_t kvu_ep_create(ucp_worker_h w, const void *addr, kvu_ep *e, ucp_ep_h *ep) {
	ucp_ep_params_t p;
	memset(&p, 0, sizeof p);
	p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
		UCP_EP_PARAM_FIELD_ERR_HANDLER;
	p.address = (const ucp_address_t *)addr;
	p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
	p.err_handler.cb = kvu_ep_err;
	p.err_handler.arg = e;
	return ucp_ep_create(w, &p, ep);
}

// kvu_ep_close closes ep (forced or flushing) and progresses w until the
// close completes. It returns the close's status.
ucs_status_t kvu_ep_close(ucp_worker_h w, ucp_ep_h ep, int force) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
	p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
	ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
	if (r == NULL) return UCS_OK;
	if (UCS_PTR_IS_ERR(r)) return UCS_PTR_STATUS(r);
	ucs_status_t st;
	for (int i = 0; i < 1000000; i++) {
		ucp_worker_progress(w);
		st = ucp_request_check_status(r);
		if (st != UCS_INPROGRESS) break;
	}
	ucp_request_free(r);
	return st;
}

ucs_status_t kvu_mem_map(ucp_context_h ctx, uintptr_t addr, size_t len, int cuda, ucp_mem_h *memh) {
	ucp_mem_map_params_t p;
	memset(&p, 0, sizeof p);
	p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
		UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
	p.address = (void *)addr;
	p.length = len;
	p.memory_type = cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
	return ucp_mem_map(ctx, &p, memh);
}

// kvu_get posts one get. It returns 1 when the get completed at once
// (status in *st), 0 when its completion will be counted in b, -1 on an
// immediate error (in *st).
int kvu_get(ucp_ep_h ep, uintptr_t buf, size_t len, ucp_mem_h memh, uint64_t raddr, ucp_rkey_h rkey,
		kvu_batch *b, ucs_status_t *st) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
	p.cb.send = kvu_batch_cb;
	p.user_data = b;
	p.memh = memh;
	ucs_status_ptr_t r = ucp_get_nbx(ep, (void *)buf, len, raddr, rkey, &p);
	if (r == NULL) { *st = UCS_OK; return 1; }
	if (UCS_PTR_IS_ERR(r)) { *st = UCS_PTR_STATUS(r); return -1; }
	return 0;
}

// kvu_worker_flush flushes w, progressing it at most spins times. It
// returns UCS_INPROGRESS when the flush did not complete (the request is
// then left to ucp_worker_destroy).
ucs_status_t kvu_worker_flush(ucp_worker_h w, int spins) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	ucs_status_ptr_t r = ucp_worker_flush_nbx(w, &p);
	if (r == NULL) return UCS_OK;
	if (UCS_PTR_IS_ERR(r)) return UCS_PTR_STATUS(r);
	ucs_status_t st = UCS_INPROGRESS;
	for (int i = 0; i < spins; i++) {
		ucp_worker_progress(w);
		st = ucp_request_check_status(r);
		if (st != UCS_INPROGRESS) break;
	}
	ucp_request_free(r); // released by UCX once complete, if it is not yet
	return st;
}

// kvu_flush posts an endpoint flush; like kvu_get.
int kvu_flush(ucp_ep_h ep, kvu_op *o, ucs_status_t *st) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
	p.cb.send = kvu_op_cb;
	p.user_data = o;
	ucs_status_ptr_t r = ucp_ep_flush_nbx(ep, &p);
	if (r == NULL) { *st = UCS_OK; return 1; }
	if (UCS_PTR_IS_ERR(r)) { *st = UCS_PTR_STATUS(r); return -1; }
	return 0;
}

static void kvu_recv_cb(void *req, ucs_status_t st, const ucp_tag_recv_info_t *info, void *user) {
	kvu_recv *r = (kvu_recv *)user;
	r->status = st;
	r->length = (st == UCS_OK && info != NULL) ? info->length : 0;
	r->done = 1;
	r->req = NULL;
	if (r->batch != NULL) kvu_batch_done(r->batch, st);
	ucp_request_free(req);
}

// kvu_tag_recv posts a receive of exactly tag into buf (count bytes, or
// count ucp_dt_iov_t entries when iov). Completion always comes through
// kvu_recv_cb; it returns -1 on an immediate error (r is then done).
int kvu_tag_recv(ucp_worker_h w, uintptr_t buf, size_t count, int iov, uint64_t tag, kvu_recv *r) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
	if (iov) {
		p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
		p.datatype = ucp_dt_make_iov();
	}
	p.cb.recv = kvu_recv_cb;
	p.user_data = r;
	ucs_status_ptr_t q = ucp_tag_recv_nbx(w, (void *)buf, count, tag, (ucp_tag_t)-1, &p);
	if (UCS_PTR_IS_ERR(q)) {
		r->done = 1;
		r->status = UCS_PTR_STATUS(q);
		if (r->batch != NULL) kvu_batch_done(r->batch, r->status);
		return -1;
	}
	if (q == NULL) { // completed at once despite NO_IMM_CMPL: length unknown
		r->done = 1;
		r->status = UCS_ERR_NO_MESSAGE;
		if (r->batch != NULL) kvu_batch_done(r->batch, r->status);
		return -1;
	}
	r->req = q;
	return 0;
}

// kvu_recv_cancel asks UCX to cancel r if it is still outstanding (a
// receive not yet matched completes with UCS_ERR_CANCELED; a matched one
// completes as usual).
void kvu_recv_cancel(ucp_worker_h w, kvu_recv *r) {
	if (!r->done && r->req != NULL) ucp_request_cancel(w, r->req);
}

// kvu_tag_send posts a send of buf (count bytes, or count ucp_dt_iov_t
// entries when iov) with tag; like kvu_get.
int kvu_tag_send(ucp_ep_h ep, uintptr_t buf, size_t count, int iov, uint64_t tag, kvu_batch *b,
		ucs_status_t *st) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
	if (iov) {
		p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
		p.datatype = ucp_dt_make_iov();
	}
	p.cb.send = kvu_batch_cb;
	p.user_data = b;
	ucs_status_ptr_t r = ucp_tag_send_nbx(ep, (const void *)buf, count, tag, &p);
	if (r == NULL) { *st = UCS_OK; return 1; }
	if (UCS_PTR_IS_ERR(r)) { *st = UCS_PTR_STATUS(r); return -1; }
	return 0;
}

void kvu_iov_set(ucp_dt_iov_t *v, size_t i, uintptr_t addr, size_t len) {
	v[i].buffer = (void *)addr;
	v[i].length = len;
}

void *kvu_ptr(uintptr_t a) { return (void *)a; }
