package ucx

/*
#cgo LDFLAGS: -lucp -lucs
#include <stdlib.h>
#include <unistd.h>
#include <ucs/config/global_opts.h>
#include "ucp_shims.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"go.uber.org/atomic"
)

// setLogLevel sets UCX's log level. UCX reads UCX_LOG_LEVEL when the
// library loads, before any Go code runs: tests that set the variable in
// init use this for their own process.
func setLogLevel(level string) error {
	cn, cv := C.CString("LOG_LEVEL"), C.CString(level)
	defer C.free(unsafe.Pointer(cn))
	defer C.free(unsafe.Pointer(cv))
	return status(C.ucs_global_opts_set_value(cn, cv))
}

// context is one ucp_context (shared by the workers of a Sender or a
// Receiver; UCP_PARAM_FIELD_MT_WORKERS_SHARED makes mem_map safe from any
// thread).
type context struct {
	h         C.ucp_context_h
	abandoned atomic.Int64 // workers abandoned (see settle): the context must outlive them
}

// abandoned counts the workers of this process abandoned instead of
// destroyed (see worker.settle).
var abandoned atomic.Int64

// Abandoned returns how many UCX workers this process abandoned rather
// than destroy: a revocation whose peer never finished its handshake
// (UCX 1.13 cannot destroy such a worker). Each holds a few sockets and
// some memory until the process exits; none is ever progressed again.
func Abandoned() int64 { return abandoned.Load() }

// newContext initialises UCX: with remote memory access when rma (the
// pull model), with tagged messages only otherwise (the push model).
func newContext(rma bool) (*context, error) {
	var h C.ucp_context_h
	r := C.int(0)
	if rma {
		r = 1
	}
	if err := status(C.kvu_init(&h, r)); err != nil {
		return nil, fmt.Errorf("ucx: ucp_init: %w", err)
	}
	return &context{h: h}, nil
}

// close releases the context, unless a worker of it was abandoned.
func (c *context) close() {
	if c.abandoned.Load() == 0 {
		C.ucp_cleanup(c.h)
	}
}

// memh is one registration (ucp_mem_map) of a run of contiguous memory.
type memh struct {
	h    C.ucp_mem_h
	addr uintptr
	len  int
}

func (c *context) memMap(addr uintptr, n int, cuda bool) (*memh, error) {
	var h C.ucp_mem_h
	cu := C.int(0)
	if cuda {
		cu = 1
	}
	if err := status(C.kvu_mem_map(c.h, C.uintptr_t(addr), C.size_t(n), cu, &h)); err != nil {
		return nil, fmt.Errorf("ucx: ucp_mem_map of %d bytes: %w", n, err)
	}
	return &memh{h: h, addr: addr, len: n}, nil
}

// unmap revokes the registration: ucp_mem_unmap.
func (c *context) unmap(m *memh) error {
	if err := status(C.ucp_mem_unmap(c.h, m.h)); err != nil {
		return fmt.Errorf("ucx: ucp_mem_unmap: %w", err)
	}
	return nil
}

// rkeyPack packs m's remote key (ucp_rkey_pack).
func (c *context) rkeyPack(m *memh) ([]byte, error) {
	var buf unsafe.Pointer
	var n C.size_t
	if err := status(C.ucp_rkey_pack(c.h, m.h, &buf, &n)); err != nil {
		return nil, fmt.Errorf("ucx: ucp_rkey_pack: %w", err)
	}
	b := C.GoBytes(buf, C.int(n))
	C.ucp_rkey_buffer_release(buf)
	return b, nil
}

// worker is one ucp_worker in UCS_THREAD_MODE_SINGLE, driven by one
// goroutine locked to its OS thread: every UCX call on the worker, its
// endpoints and requests runs on that thread (do/call), and so do the
// completion callbacks (inside ucp_worker_progress).
type worker struct {
	h    C.ucp_worker_h
	efd  C.int
	wake C.int

	mu      sync.Mutex
	queue   []task
	stopped bool
	exited  chan struct{}

	// Owned by the worker's thread.
	pollers []func() bool // run after each progress; true when finished
	stop    bool
	moved   bool // the last progress call did something
	abandon bool // stop without ucp_worker_destroy (see settle)
	ctx     *context
}

// newWorker creates a worker and starts its thread.
func (c *context) newWorker() (*worker, error) {
	w := &worker{exited: make(chan struct{}), ctx: c}
	ready := make(chan error, 1)
	go w.loop(c, ready)
	if err := <-ready; err != nil {
		return nil, err
	}
	return w, nil
}

func (w *worker) loop(c *context, ready chan<- error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	defer close(w.exited)
	var efd C.int
	if err := status(C.kvu_worker(c.h, &w.h, &efd)); err != nil {
		ready <- fmt.Errorf("ucx: ucp_worker_create: %w", err)
		return
	}
	w.efd = efd
	w.wake = C.kvu_eventfd()
	if w.wake < 0 {
		C.ucp_worker_destroy(w.h)
		ready <- errors.New("ucx: eventfd failed")
		return
	}
	ready <- nil
	for {
		w.mu.Lock()
		q := w.queue
		w.queue = nil
		w.mu.Unlock()
		for _, t := range q {
			t.f()
		}
		if w.stop {
			break
		}
		w.moved = C.kvu_progress(w.h) > 0
		live := w.pollers[:0]
		for _, p := range w.pollers {
			if !p() {
				live = append(live, p)
			}
		}
		clear(w.pollers[len(live):])
		w.pollers = live
		w.mu.Lock()
		more := len(w.queue) > 0
		w.mu.Unlock()
		if more {
			continue
		}
		if len(w.pollers) > 0 {
			C.kvu_wait(w.h, w.efd, w.wake, 10)
		} else {
			C.kvu_wait(w.h, w.efd, w.wake, 200)
		}
	}
	if w.abandon {
		c.abandoned.Add(1)
		abandoned.Add(1)
	} else {
		C.ucp_worker_destroy(w.h)
	}
	// Anything queued after the stop would run against a destroyed
	// worker: it never runs; callers waiting in call are let go.
	w.mu.Lock()
	w.stopped = true
	C.close(w.wake)
	q := w.queue
	w.queue = nil
	w.mu.Unlock()
	for _, t := range q {
		if t.gone != nil {
			t.gone()
		}
	}
}

// task is a function queued for the worker's thread; gone, if set, runs
// instead when the worker was destroyed first.
type task struct{ f, gone func() }

// do queues f to run on the worker's thread. It reports false when the
// worker is destroyed (f then never runs).
func (w *worker) do(f func()) bool { return w.queueTask(task{f: f}) }

func (w *worker) queueTask(t task) bool {
	w.mu.Lock()
	if w.stopped {
		w.mu.Unlock()
		return false
	}
	w.queue = append(w.queue, t)
	C.kvu_wake(w.wake) // under mu: the fd closes only once stopped is set
	w.mu.Unlock()
	return true
}

// call runs f on the worker's thread and waits for it; errWorkerGone
// when the worker was destroyed first.
func (w *worker) call(f func()) error {
	done := make(chan struct{})
	ran := false
	if !w.queueTask(task{f: func() { ran = true; f(); close(done) }, gone: func() { close(done) }}) {
		return errWorkerGone
	}
	<-done
	if !ran {
		return errWorkerGone
	}
	return nil
}

// destroy stops the loop and destroys the worker (ucp_worker_destroy,
// which closes its endpoints and frees its requests), then waits for the
// thread to exit. After it returns no UCX callback of this worker can run.
func (w *worker) destroy(before func()) {
	if w.do(func() {
		if before != nil {
			before()
		}
		w.stop = true
	}) {
		<-w.exited
	} else {
		<-w.exited
	}
}

// settle lets the worker finish its connection handshakes before it is
// destroyed: a bounded worker flush. UCX 1.13 aborts the process when
// ucp_worker_destroy purges a wireup reply still pending (the peer never
// took it: it is stopped or hung). When the flush does not complete, the
// worker is abandoned instead of destroyed: never progressed again
// (nothing of it runs, so it serves no get), never freed. Worker thread
// only.
func (w *worker) settle() {
	if C.kvu_worker_flush(w.h, 20000) == C.UCS_INPROGRESS {
		w.abandon = true
	}
}

// address returns the worker's address (ucp_worker_get_address). Worker
// thread only.
func (w *worker) address() ([]byte, error) {
	var a *C.ucp_address_t
	var n C.size_t
	if err := status(C.ucp_worker_get_address(w.h, &a, &n)); err != nil {
		return nil, fmt.Errorf("ucx: ucp_worker_get_address: %w", err)
	}
	b := C.GoBytes(unsafe.Pointer(a), C.int(n))
	C.ucp_worker_release_address(w.h, a)
	return b, nil
}

// endpoint is a ucp_ep with its error state. Worker thread only.
type endpoint struct {
	h   C.ucp_ep_h
	err *C.kvu_ep // C memory: UCX's error handler writes it
}

func (w *worker) connect(addr []byte) (*endpoint, error) {
	ca := C.CBytes(addr)
	defer C.free(ca)
	e := &endpoint{err: (*C.kvu_ep)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvu_ep{}))))}
	if err := status(C.kvu_ep_create(w.h, ca, e.err, &e.h)); err != nil {
		C.free(unsafe.Pointer(e.err))
		return nil, fmt.Errorf("ucx: ucp_ep_create: %w", err)
	}
	return e, nil
}

// failed returns the endpoint's error, once UCX reported one. It may
// be called from any thread while the endpoint is open (the error
// handler runs on the worker's thread and publishes its status before
// the flag).
func (e *endpoint) failed() error {
	if C.kvu_ep_failed(e.err) == 0 {
		return nil
	}
	return fmt.Errorf("ucx: endpoint failed: %w", ucsError(e.err.status))
}

// close closes the endpoint (ucp_ep_close_nbx, forced or flushing) and
// waits for the close to complete; the error state is freed afterwards.
func (w *worker) closeEP(e *endpoint, force bool) error {
	f := C.int(0)
	if force {
		f = 1
	}
	err := status(C.kvu_ep_close(w.h, e.h, f))
	C.free(unsafe.Pointer(e.err))
	e.err = nil
	return err
}

// rkey is an unpacked remote key. Worker thread only.
type rkey struct{ h C.ucp_rkey_h }

func (e *endpoint) unpack(b []byte) (*rkey, error) {
	cb := C.CBytes(b)
	defer C.free(cb)
	var h C.ucp_rkey_h
	if err := status(C.ucp_ep_rkey_unpack(e.h, cb, &h)); err != nil {
		return nil, fmt.Errorf("ucx: ucp_ep_rkey_unpack: %w", err)
	}
	return &rkey{h: h}, nil
}

func (k *rkey) destroy() { C.ucp_rkey_destroy(k.h) }

// batch counts a group of requests' completions (C memory).
type batch struct{ b *C.kvu_batch }

func newBatch() batch {
	return batch{(*C.kvu_batch)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvu_batch{}))))}
}

func (b batch) free()           { C.free(unsafe.Pointer(b.b)) }
func (b batch) completed() int  { return int(b.b.completed) }
func (b batch) failedN() int    { return int(b.b.failed) }
func (b batch) firstErr() error { return status(b.b.first) }

// get posts ucp_get_nbx of n bytes from raddr into local. It returns
// whether it completed at once, and an immediate error.
func (e *endpoint) get(local uintptr, n int, m *memh, raddr uint64, k *rkey, b batch) (bool, error) {
	var st C.ucs_status_t
	var mh C.ucp_mem_h
	if m != nil {
		mh = m.h
	}
	r := C.kvu_get(e.h, C.uintptr_t(local), C.size_t(n), mh, C.uint64_t(raddr), k.h, b.b, &st)
	switch r {
	case 1:
		return true, nil
	case 0:
		return false, nil
	}
	return false, fmt.Errorf("ucx: ucp_get_nbx: %w", ucsError(st))
}

// op is one request we wait for (C memory).
type op struct{ o *C.kvu_op }

func newOp() op         { return op{(*C.kvu_op)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvu_op{}))))} }
func (o op) free()      { C.free(unsafe.Pointer(o.o)) }
func (o op) done() bool { return o.o.done != 0 }
func (o op) err() error { return status(o.o.status) }

// flush posts ucp_ep_flush_nbx; completion is recorded in o (done at once
// when it returns true).
func (e *endpoint) flush(o op) (bool, error) {
	var st C.ucs_status_t
	switch C.kvu_flush(e.h, o.o, &st) {
	case 1:
		o.o.done, o.o.status = 1, C.UCS_OK
		return true, nil
	case 0:
		return false, nil
	}
	o.o.done, o.o.status = 1, st
	return true, fmt.Errorf("ucx: ucp_ep_flush_nbx: %w", ucsError(st))
}

// flushWait flushes e and progresses the worker until the flush completes
// (at most spins progress calls). Worker thread only.
func (w *worker) flushWait(e *endpoint, spins int) error {
	o := newOp()
	done, err := e.flush(o)
	for i := 0; !done && i < spins; i++ {
		C.kvu_progress(w.h)
		done = o.done()
		if ferr := e.failed(); ferr != nil && !done {
			// The flush's callback may still run: its state stays
			// allocated (a few bytes) rather than freed under it.
			return ferr
		}
	}
	if !done {
		return errors.New("ucx: endpoint flush did not complete")
	}
	defer o.free()
	if err != nil {
		return err
	}
	return o.err()
}

// progressOnce progresses the worker until it is idle. Worker thread only.
func (w *worker) progressOnce() { C.kvu_progress(w.h) }

// cbuf is C memory (the run table a source exposes, the copy a
// destination reads it into): outside the Go heap, so UCX may hold it.
type cbuf struct {
	p unsafe.Pointer
	n int
}

func newCbuf(n int) cbuf { return cbuf{p: C.malloc(C.size_t(max(n, 1))), n: n} }

func (b cbuf) addr() uintptr { return uintptr(b.p) }
func (b cbuf) bytes() []byte { return unsafe.Slice((*byte)(b.p), b.n) }
func (b cbuf) free()         { C.free(b.p) }

// getWait reads n bytes from raddr into b with one get and progresses
// the worker until it completes (at most spins progress calls). Worker
// thread only. On a get that did not complete, b and its completion
// state must stay allocated: it reports false.
func (w *worker) getWait(e *endpoint, b cbuf, raddr uint64, k *rkey, spins int) (bool, error) {
	bt := newBatch()
	done, err := e.get(b.addr(), b.n, nil, raddr, k, bt)
	if err != nil {
		bt.free()
		return true, err
	}
	for i := 0; !done && bt.completed() == 0 && i < spins; i++ {
		C.kvu_progress(w.h)
		if e.failed() != nil && bt.completed() == 0 {
			return false, e.failed()
		}
	}
	if !done && bt.completed() == 0 {
		return false, errors.New("ucx: get did not complete")
	}
	defer bt.free()
	if bt.failedN() > 0 {
		return true, fmt.Errorf("ucx: ucp_get_nbx: %w", bt.firstErr())
	}
	return true, nil
}

// iovs is an array of ucp_dt_iov_t in C memory: the pieces of blocks, as
// UCX gathers (send) or scatters (receive) one block's message.
type iovs struct {
	p *C.ucp_dt_iov_t
	n int
}

func newIovs(spans []Span) iovs {
	v := iovs{p: (*C.ucp_dt_iov_t)(C.calloc(C.size_t(max(len(spans), 1)), C.size_t(unsafe.Sizeof(C.ucp_dt_iov_t{})))), n: len(spans)}
	for i, sp := range spans {
		C.kvu_iov_set(v.p, C.size_t(i), C.uintptr_t(sp.Addr), C.size_t(sp.Len))
	}
	return v
}

func (v iovs) free() {
	if v.p != nil {
		C.free(unsafe.Pointer(v.p))
	}
}

// at returns the address of entry i.
func (v iovs) at(i int) uintptr { return uintptr(unsafe.Pointer(&unsafe.Slice(v.p, v.n)[i])) }

// hostBytes returns the bytes of a host span, for the plane's own
// integrity sums (the regions are the plane's to read or write while
// their transfer is attached).
func hostBytes(sp Span) []byte {
	if sp.pin != nil {
		return unsafe.Slice((*byte)(sp.pin), sp.Len)
	}
	return unsafe.Slice((*byte)(C.kvu_ptr(C.uintptr_t(sp.Addr))), sp.Len)
}

// send posts ucp_tag_send_nbx of n bytes at buf (or n iov entries at buf
// when iov) with tag; completion is counted in b. It returns whether it
// completed at once, and an immediate error.
func (e *endpoint) send(buf uintptr, n int, iov bool, tag uint64, b batch) (bool, error) {
	var st C.ucs_status_t
	v := C.int(0)
	if iov {
		v = 1
	}
	switch C.kvu_tag_send(e.h, C.uintptr_t(buf), C.size_t(n), v, C.uint64_t(tag), b.b, &st) {
	case 1:
		return true, nil
	case 0:
		return false, nil
	}
	return false, fmt.Errorf("ucx: ucp_tag_send_nbx: %w", ucsError(st))
}

// recvs is an array of kvu_recv in C memory, one per posted receive,
// whose completions are also counted in a batch.
type recvs struct {
	p *C.kvu_recv
	n int
	b batch
}

func newRecvs(n int) recvs {
	r := recvs{p: (*C.kvu_recv)(C.calloc(C.size_t(max(n, 1)), C.size_t(unsafe.Sizeof(C.kvu_recv{})))), n: n, b: newBatch()}
	for i := range n {
		r.at(i).batch = r.b.b
	}
	return r
}

func (r recvs) free() {
	if r.p != nil {
		C.free(unsafe.Pointer(r.p))
		r.b.free()
	}
}

func (r recvs) at(i int) *C.kvu_recv { return &unsafe.Slice(r.p, r.n)[i] }

// result reports whether receive i completed, its length and its status.
func (r recvs) result(i int) (done bool, n int, err error) {
	x := r.at(i)
	return x.done != 0, int(x.length), status(x.status)
}

// recv posts receive i: n bytes at buf (or n iov entries when iov) with
// exactly tag. Worker thread only.
func (w *worker) recv(r recvs, i int, buf uintptr, n int, iov bool, tag uint64) error {
	v := C.int(0)
	if iov {
		v = 1
	}
	if C.kvu_tag_recv(w.h, C.uintptr_t(buf), C.size_t(n), v, C.uint64_t(tag), r.at(i)) != 0 {
		return fmt.Errorf("ucx: ucp_tag_recv_nbx: %w", ucsError(r.at(i).status))
	}
	return nil
}

// stray reports whether a message that no posted receive asked for
// waits in the worker's unexpected queue (ucp_tag_probe_nb, any tag,
// not removed). Worker thread only.
func (w *worker) stray() bool {
	var info C.ucp_tag_recv_info_t
	return C.ucp_tag_probe_nb(w.h, 0, 0, 0, &info) != nil
}

// cancel asks UCX to cancel receive i if it is outstanding. Worker
// thread only.
func (w *worker) cancel(r recvs, i int) { C.kvu_recv_cancel(w.h, r.at(i)) }
