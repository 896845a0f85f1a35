package ucx

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

var (
	// ErrCorrupt wraps plane bytes (Accept or Start) that are malformed or
	// do not match the regions they describe.
	ErrCorrupt = errors.New("ucx: malformed plane bytes")
	// ErrRevoked wraps the outcome of a transfer whose evidence is a
	// revocation: the handoff's registration was unmapped and its worker
	// destroyed, so nothing of UCX in this process touches the regions
	// any more.
	ErrRevoked = errors.New("ucx: registration revoked")
	// ErrClosed is the cause recorded for transfers revoked by Close.
	ErrClosed = errors.New("ucx: plane closed")
)

// errPullSecure refuses the pull model in an authenticated session: its
// blocks carry no sums bound to the session, and its source's worker
// serves the destination any address (see Trust in the package doc).
var errPullSecure = fmt.Errorf("ucx: the pull model (Config.Pull) binds nothing to an authenticated session: push (the default), or run the halves Insecure on a trusted network: %w", kvlease.ErrInvalidArgument)

const (
	version = 2
	// How the Start bytes carry the run table: inline, or as the
	// address, length and key of a registered copy the destination reads.
	tableInline, tableRemote = 0, 1
	// acceptLength is "KU", version, block count.
	acceptLength = 2 + 1 + 4
)

// Config configures a Sender or a Receiver. The zero value is usable.
type Config struct {
	// Window bounds the gets one handoff has outstanding (16 when zero).
	Window int
	// MaxGet bounds the bytes of one get (pull) or one message (push):
	// blocks adjacent in memory (a run) are read with one get (pull:
	// adjacent on both sides) or sent as one message (push: adjacent in
	// the source's memory) up to this size (1 MiB when zero; a value
	// below the block size moves one block per get or message). Pushed,
	// the destination's value travels in its Accept bytes and the
	// source cuts its runs at the smaller of the two; it also bounds
	// what a cancel cannot withdraw (a receive a message already
	// matched).
	MaxGet int
	// ConnectSpins bounds the progress calls the destination spends
	// connecting to a handoff's source before it gives up (before
	// anything is attached; 1e6 when zero).
	ConnectSpins int
	// BeforeGet, if set, runs on the destination's worker thread before
	// the get that starts at block is posted (pull), or, for each block
	// of a message, before the message's receive is posted (push): fault
	// injection, tests stop or abort a handoff there. It must not call
	// into the plane.
	BeforeGet func(id handoff.PlaneID, block int)
	// BeforeSend, if set, runs on the source's worker thread, for each
	// block of a message, before the message is posted (push model;
	// fault injection). It must not call into the plane.
	BeforeSend func(id handoff.PlaneID, block int)
	// Pull selects the pull model (the destination reads the source's
	// registered pieces with ucp_get_nbx) instead of the default push
	// model (the source sends its pieces as tagged messages). Both sides
	// must agree: a sender refuses the other model's Accept bytes. Pull
	// trusts the destination with the source process's memory: UCX 1.13
	// serves, in software, a get (or a put) whose remote key names no
	// hardware registration, at any address the destination names, on
	// every transport (see Trust in the package doc). Set it only when the
	// destination is as trusted as the source process itself.
	Pull bool
	// MaxIdle bounds the idle connections (push model) a side keeps per
	// control session for the handoffs that follow: a source's workers
	// each with its endpoint to a destination's worker, a destination's
	// workers (4 when zero; negative keeps none: a worker and a
	// connection per handoff). A connection serves one handoff at a time
	// and is kept only after a handoff that ended cleanly on its side.
	MaxIdle int
	// IdleTimeout is how long an idle connection is kept (zero: 30 s on
	// a Sender, 60 s on a Receiver). Keep the destination's longer than
	// the source's: the source then drops its endpoint before the
	// destination destroys the worker it is connected to.
	IdleTimeout time.Duration
}

func (c *Config) defaults() {
	if c.Window <= 0 {
		c.Window = 16
	}
	if c.MaxGet <= 0 {
		c.MaxGet = 1 << 20
	}
	if c.ConnectSpins <= 0 {
		c.ConnectSpins = 1_000_000
	}
	if c.MaxIdle == 0 {
		c.MaxIdle = defaultMaxIdle
	}
}

// Stats counts what a plane did.
type Stats struct {
	// Started counts attached transfers; Completed those resolved with
	// every block delivered (destination) or with the destination's done
	// (source); Canceled those that stopped on a cancel with a completed
	// flush; Revoked those whose evidence is a revocation.
	Started, Completed, Canceled, Revoked int
	// Bytes counts bytes read by completed gets (destination).
	Bytes int64
	// Registrations counts the ucp_mem_map calls on region memory (one
	// per contiguous run of a handoff's pieces; a run table's copy is not
	// counted) and RegisteredBytes their bytes: exactly the pieces'.
	Registrations   int
	RegisteredBytes int64
	// Gets counts the gets posted (destination, pull model).
	Gets int
	// Messages counts the messages posted (push model): sends on the
	// source, receives on the destination; one per run of blocks
	// adjacent in the source's memory (cut at MaxGet), one per other
	// block. The sums table's message is not counted.
	Messages int
	// Keyed counts the started handoffs whose blocks carry sums keyed by
	// their authenticated session (IntegrityMAC); the others carry
	// crc32c (an insecure session), or nothing (device memory, pull).
	Keyed int
	// Workers counts the UCX workers created for the push model's
	// connections (the pull model's per-handoff workers are not
	// counted); Connects the endpoints created to a peer's worker (the
	// source's with a handshake); Reuses the handoffs that took an idle
	// connection instead (source: an endpoint to the worker the
	// destination named; destination: a worker of the session); Expired
	// the idle connections destroyed after Config.IdleTimeout; Broken
	// the connections dropped because their endpoint failed (found idle
	// or checked out). Idle is the connections idle now. Strays counts
	// the destination's workers not kept after a handoff because a
	// message no receive asked for was waiting in them.
	Workers, Connects, Reuses, Expired, Broken, Idle, Strays int
}

type counters struct {
	mu sync.Mutex
	s  Stats
}

func (c *counters) add(f func(*Stats)) {
	c.mu.Lock()
	f(&c.s)
	c.mu.Unlock()
}

func (c *counters) get() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.s
}

// MemoryType says where a region's memory lives, as UCX registers it
// (ucp_mem_map's memory_type).
type MemoryType int

const (
	// Host is CPU memory: Go memory (kvlease.HostMemory) or pinned host
	// memory (a gpu.PinnedArena).
	Host MemoryType = iota
	// CUDA is device memory (a gpu.DeviceArena): registered as
	// UCS_MEMORY_TYPE_CUDA, which needs a UCX built with CUDA support.
	CUDA
)

// Span is a region as the plane registers it: its address, its length
// and its memory type.
type Span struct {
	Addr   uintptr
	Len    int
	Memory MemoryType
	pin    unsafe.Pointer // Go memory to pin while registered
}

// HostBytes locates a []byte region (Go or pinned host memory). Go
// memory stays pinned (runtime.Pinner) while a handoff has it registered.
func HostBytes(b []byte) Span {
	p := unsafe.Pointer(unsafe.SliceData(b))
	return Span{Addr: uintptr(p), Len: len(b), Memory: Host, pin: p}
}

// Sender is the source side's plane. Pushing (the default), each handoff
// takes the sender's idle endpoint to the destination's worker (or
// connects to it; see Connections in the package doc) and sends each run
// of blocks adjacent in memory, and each other block, as a tagged
// message, then the blocks' sums; pulling (Config.Pull), it starts a UCX
// worker of the handoff's own, registers the regions' pieces (one
// ucp_mem_map per contiguous run of them) and puts the worker's address
// and the packed remote keys in the Start bytes. A cancel, or Finish with
// the destination's error, revokes; Close revokes everything and
// destroys the idle connections. It is safe for concurrent use.
type Sender[R any] struct {
	cfg    Config
	ctx    *context
	pieces func(R, []Span) []Span
	stats  counters
	keys   sessionKeys
	pool   *pool // idle connections (push)

	mu      sync.Mutex
	jobs    map[handoff.PlaneID]*sendJob[R]
	closed  bool
	closing chan struct{} // closed by Close: ends a pull SendStream's wait
	wg      sync.WaitGroup
}

var _ handoff.SendPlane[[]byte] = (*Sender[[]byte])(nil)

// NewSender initialises UCX (ucp_init; UCX_TLS and the other UCX_*
// environment variables apply) and returns a sender plane for host
// memory regions.
func NewSender(cfg Config) (*Sender[[]byte], error) { return NewSenderOf(cfg, HostBytes) }

// NewSenderOf returns a sender plane for regions of any type, located by
// loc (see the package doc for device memory).
func NewSenderOf[R any](cfg Config, loc func(R) Span) (*Sender[R], error) {
	if loc == nil {
		return nil, fmt.Errorf("ucx: nil locator: %w", kvlease.ErrInvalidArgument)
	}
	return newSender(cfg, onePiece(loc))
}

func newSender[R any](cfg Config, pieces func(R, []Span) []Span) (*Sender[R], error) {
	cfg.defaults()
	ctx, err := newContext(cfg.Pull)
	if err != nil {
		return nil, err
	}
	ttl := cfg.IdleTimeout
	if ttl <= 0 {
		ttl = defaultSenderIdle
	}
	s := &Sender[R]{cfg: cfg, ctx: ctx, pieces: pieces, jobs: make(map[handoff.PlaneID]*sendJob[R]), closing: make(chan struct{})}
	s.pool = newPool(cfg.MaxIdle, ttl, &s.stats)
	return s, nil
}

// sendJob is one handoff's registration.
type sendJob[R any] struct {
	s     *Sender[R]
	id    handoff.PlaneID
	w     *worker
	memhs []*memh
	pin   runtime.Pinner
	t     *kvlease.Transfer
	once  sync.Once
	table cbuf // the run table, when it does not fit the Start bytes
	// attached is set under Sender.mu once attach succeeded: Close
	// revokes those; Send itself revokes one attached after Close.
	attached bool
	push     *pushSend // the push model's state, or nil
	c        *conn     // the push model's connection (w is its worker)
	// halt is set when the job is revoked: its worker posts no further
	// message, even before the worker is destroyed.
	halt atomic.Bool
	// sent is set (push) once every message and the table were posted
	// and every send completed: the worker's thread is done with the job.
	sent atomic.Bool
}

func parseAccept(b []byte) (int, error) {
	if len(b) > 2 && b[0] == 'K' && b[1] == 'U' && b[2] == pushVersion {
		return 0, fmt.Errorf("ucx: the destination expects the push model, this sender pulls (Config.Pull): %w", ErrCorrupt)
	}
	if len(b) != acceptLength || b[0] != 'K' || b[1] != 'U' || b[2] != version {
		return 0, fmt.Errorf("ucx: accept bytes of %d: %w", len(b), ErrCorrupt)
	}
	return int(binary.LittleEndian.Uint32(b[3:])), nil
}

// Send implements handoff.SendPlane. Pushing, it takes its idle endpoint
// to the destination's worker named in the Accept bytes (or connects to
// it), attaches the transfer,
// starts sending the blocks and returns the Start bytes (a block's piece
// sizes, the block count, the integrity mode, a random nonce, the
// handoff worker's address, the most blocks of one message, the runs).
// Pulling, it registers the regions' pieces for this handoff alone,
// attaches the transfer and returns the Start bytes: the handoff
// worker's address, a block's piece sizes, per contiguous run of pieces
// its address, its length and its packed remote key, and where the
// pieces lie (the segments). Accept bytes of the
// other model are refused with ErrCorrupt; regions whose pieces disagree
// or overlap with kvlease.ErrInvalidArgument, before anything is sent or
// registered. The transfer resolves on Finish or a cancel, after the
// revocation (see the package doc).
func (s *Sender[R]) Send(id handoff.PlaneID, regions []R, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	if !s.cfg.Pull {
		return s.sendPush(id, regions, accept, attach, nil)
	}
	return s.sendPull(id, regions, accept, attach)
}

// sendPull is Send in the pull model.
func (s *Sender[R]) sendPull(id handoff.PlaneID, regions []R, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	if s.keys.secure(id) {
		return nil, errPullSecure
	}
	blocks, err := parseAccept(accept)
	if err != nil {
		return nil, err
	}
	if blocks != len(regions) {
		return nil, fmt.Errorf("ucx: destination prepared %d blocks, source sends %d: %w", blocks, len(regions), ErrCorrupt)
	}
	j, err := s.enroll(id, nil)
	if err != nil {
		return nil, err
	}
	fail := func(err error) ([]byte, error) {
		j.teardown()
		s.unenroll(id)
		return nil, err
	}
	g, err := locate(s.pieces, regions, &j.pin)
	if err != nil {
		return fail(err)
	}
	regs, err := registrations(g.spans)
	if err != nil {
		return fail(err)
	}
	if j.w, err = s.ctx.newWorker(); err != nil {
		return fail(err)
	}
	start := appendStartHead(nil, version, g.sizes, len(regions))
	var addr []byte
	if cerr := j.w.call(func() { addr, err = j.w.address() }); cerr != nil {
		err = cerr
	}
	if err != nil {
		return fail(err)
	}
	start = binary.LittleEndian.AppendUint16(start, uint16(len(addr)))
	start = append(start, addr...)
	keys := make([][]byte, len(regs))
	for i, r := range regs {
		m, err := s.ctx.memMap(r.addr, r.n, r.mem == CUDA)
		if err != nil {
			return fail(err)
		}
		s.stats.add(func(st *Stats) { st.Registrations++; st.RegisteredBytes += int64(r.n) })
		j.memhs = append(j.memhs, m)
		if keys[i], err = s.ctx.rkeyPack(m); err != nil {
			return fail(err)
		}
	}
	segs, pieceMajor := segmentsOf(g)
	table := appendTable(nil, regs, keys, segs, pieceMajor)
	if len(start)+1+len(table) <= handoff.MaxPlane {
		start = append(append(start, tableInline), table...)
	} else {
		// Too many runs for the Start bytes: the destination reads the
		// table itself, from C memory registered with the handoff.
		j.table = newCbuf(len(table))
		copy(j.table.bytes(), table)
		m, err := s.ctx.memMap(j.table.addr(), j.table.n, false)
		if err != nil {
			return fail(err)
		}
		j.memhs = append(j.memhs, m)
		key, err := s.ctx.rkeyPack(m)
		if err != nil {
			return fail(err)
		}
		start = append(start, tableRemote)
		start = binary.LittleEndian.AppendUint64(start, uint64(j.table.addr()))
		start = binary.LittleEndian.AppendUint32(start, uint32(j.table.n))
		start = binary.LittleEndian.AppendUint16(start, uint16(len(key)))
		start = append(start, key...)
		if len(start) > handoff.MaxPlane {
			return fail(fmt.Errorf("ucx: start bytes %d exceed %d: %w", len(start), handoff.MaxPlane, kvlease.ErrExceedsCapacity))
		}
	}
	if err := s.attachJob(j, id, attach, false); err != nil {
		return nil, err
	}
	return start, nil
}

// enroll makes the job of handoff id (push: the push model's state, or
// nil pulling) and enrolls it in s.jobs and s.wg; a closed sender or an
// id already sending is refused.
func (s *Sender[R]) enroll(id handoff.PlaneID, push *pushSend) (*sendJob[R], error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, fmt.Errorf("ucx: send: %w", ErrClosed)
	}
	if _, dup := s.jobs[id]; dup {
		return nil, fmt.Errorf("ucx: send: %v already sending: %w", id, kvlease.ErrInvalidArgument)
	}
	j := &sendJob[R]{s: s, id: id, push: push}
	s.jobs[id] = j
	s.wg.Add(1)
	return j, nil
}

// unenroll undoes enroll for a job that was never attached.
func (s *Sender[R]) unenroll(id handoff.PlaneID) {
	s.mu.Lock()
	delete(s.jobs, id)
	s.mu.Unlock()
	s.wg.Done()
}

// attachJob gives job j (enrolled in s.jobs under id) its transfer and
// attaches it, in both models: a failed attach tears the job down (nothing
// was published or sent yet: the registration or the data never left
// this process, so that is evidence) and unenrolls it; a Close that ran
// meanwhile, and did not see the transfer, revokes it (ErrClosed). keyed
// counts the handoff in Stats.Keyed.
func (s *Sender[R]) attachJob(j *sendJob[R], id handoff.PlaneID, attach func(*kvlease.Transfer) error, keyed bool) error {
	t := kvlease.NewTransfer(func() {
		go j.revoke(fmt.Errorf("ucx: source canceled: %w", ErrRevoked))
	})
	s.mu.Lock()
	j.t = t
	s.mu.Unlock()
	if err := attach(j.t); err != nil {
		j.teardown()
		j.t.Resolve(err)
		s.unenroll(id)
		return err
	}
	s.stats.add(func(st *Stats) {
		st.Started++
		if keyed {
			st.Keyed++
		}
	})
	s.mu.Lock()
	j.attached = true
	closed := s.closed
	s.mu.Unlock()
	if closed {
		j.revoke(fmt.Errorf("%w: %w", ErrClosed, ErrRevoked))
		return fmt.Errorf("ucx: send: %w", ErrClosed)
	}
	return nil
}

// teardown revokes everything the job exposed: each registration is
// unmapped (ucp_mem_unmap: a hardware transport's remote key stops
// working) and the handoff's worker is destroyed (ucp_worker_destroy:
// the software-emulated gets of UCX_TLS=tcp are served by this worker's
// progress, which never runs again).
func (j *sendJob[R]) teardown() {
	j.halt.Store(true)
	if j.c != nil {
		j.c.destroy() // a revocation: whatever is still being sent stops
	} else if j.w != nil {
		j.w.destroy(func() {
			if j.push != nil && j.push.ep != nil {
				// A revocation: whatever is still being sent stops.
				_ = j.w.closeEP(j.push.ep, true)
				j.push.ep = nil
			}
			j.w.settle()
		})
	}
	if j.push != nil {
		j.push.free()
	}
	for _, m := range j.memhs {
		_ = j.s.ctx.unmap(m)
	}
	j.memhs = nil
	if j.table.p != nil {
		j.table.free()
		j.table = cbuf{}
	}
	j.pin.Unpin()
}

// revoke tears the job down and resolves its transfer with cause, once.
func (j *sendJob[R]) revoke(cause error) {
	j.once.Do(func() {
		j.teardown()
		j.s.mu.Lock()
		delete(j.s.jobs, j.id)
		j.s.mu.Unlock()
		j.s.stats.add(func(st *Stats) {
			if cause == nil {
				st.Completed++
			} else {
				st.Revoked++
			}
		})
		j.t.Resolve(cause) // after the revocation: evidence
		j.s.wg.Done()
	})
}

// Finish revokes the handoff's worker (and, pulled, its registration).
// With the destination's done (peer nil: sent after its own evidence) the transfer
// resolves nil; otherwise the revocation is the evidence and the outcome
// wraps ErrRevoked.
func (s *Sender[R]) Finish(id handoff.PlaneID, peer error) {
	s.mu.Lock()
	j := s.jobs[id]
	if j != nil && !j.attached {
		j = nil // still in Send: its attach fails, or its cancel revokes
	}
	s.mu.Unlock()
	if j == nil {
		return
	}
	if peer == nil {
		if j.c != nil {
			j.release()
			return
		}
		j.revoke(nil)
		return
	}
	j.revoke(fmt.Errorf("ucx: destination gave no done (%v): %w", peer, ErrRevoked))
}

// Stats returns what the sender did.
func (s *Sender[R]) Stats() Stats {
	st := s.stats.get()
	st.Idle = s.pool.idleN()
	return st
}

// Close revokes every handoff still registered (their transfers resolve
// with ErrClosed and ErrRevoked) and releases UCX. Closing again does
// nothing.
func (s *Sender[R]) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil // closed already (UCX is released once)
	}
	close(s.closing)
	s.closed = true
	all := make([]*sendJob[R], 0, len(s.jobs))
	for _, j := range s.jobs {
		if j.attached { // the others are in Send, which sees closed
			all = append(all, j)
		}
	}
	s.mu.Unlock()
	for _, j := range all {
		j.revoke(fmt.Errorf("%w: %w", ErrClosed, ErrRevoked))
	}
	s.wg.Wait()
	s.pool.close()
	s.ctx.close()
	return nil
}

// Receiver is the destination side's plane: each handoff has a UCX
// worker to itself (pushed: an idle one of its session, or a new one;
// see Connections in the package doc; pulled: a new one). Pushed (the
// default), it posts a tagged receive per message (a run of blocks, or a
// block) into the blocks' own pieces and checks every block against its
// sum; pulled (Config.Pull), it connects to the source's handoff
// worker, unpacks the remote keys and reads the blocks with ucp_get_nbx
// into its own registered regions, then flushes the endpoint. It is safe
// for concurrent use.
type Receiver[R any] struct {
	cfg    Config
	ctx    *context
	pieces func(R, []Span) []Span
	stats  counters
	keys   sessionKeys
	pool   *pool // idle workers (push)

	mu       sync.Mutex
	prepared map[handoff.PlaneID]*prepared
	jobs     map[*recvJob[R]]struct{}
	closed   bool
	wg       sync.WaitGroup
}

var _ handoff.RecvPlane[[]byte] = (*Receiver[[]byte])(nil)

// NewReceiver initialises UCX and returns a receiver plane for host
// memory regions.
func NewReceiver(cfg Config) (*Receiver[[]byte], error) { return NewReceiverOf(cfg, HostBytes) }

// NewReceiverOf returns a receiver plane for regions of any type, located
// by loc (see the package doc for device memory).
func NewReceiverOf[R any](cfg Config, loc func(R) Span) (*Receiver[R], error) {
	if loc == nil {
		return nil, fmt.Errorf("ucx: nil locator: %w", kvlease.ErrInvalidArgument)
	}
	return newReceiver(cfg, onePiece(loc))
}

func newReceiver[R any](cfg Config, pieces func(R, []Span) []Span) (*Receiver[R], error) {
	cfg.defaults()
	ctx, err := newContext(cfg.Pull)
	if err != nil {
		return nil, err
	}
	ttl := cfg.IdleTimeout
	if ttl <= 0 {
		ttl = defaultReceiverIdle
	}
	r := &Receiver[R]{cfg: cfg, ctx: ctx, pieces: pieces, prepared: make(map[handoff.PlaneID]*prepared), jobs: make(map[*recvJob[R]]struct{})}
	r.pool = newPool(cfg.MaxIdle, ttl, &r.stats)
	return r, nil
}

// Prepare implements handoff.RecvPlane. Pushed, it takes an idle worker
// of the session (or starts one) for the handoff, and the Accept bytes
// carry the block count, a tag salt new on that worker, the most bytes
// of one message and the worker's address (the source connects to it,
// or reuses its endpoint to it). Pulled, they
// carry the block count (the source's worker address travels in Start:
// the source owns the registration, the destination connects to it);
// pull refuses an authenticated session (kvlease.ErrInvalidArgument).
func (r *Receiver[R]) Prepare(id handoff.PlaneID, blocks int) ([]byte, error) {
	if blocks <= 0 || blocks > handoff.MaxBlocks {
		return nil, fmt.Errorf("ucx: prepare %d blocks: %w", blocks, kvlease.ErrInvalidArgument)
	}
	p := &prepared{blocks: blocks}
	var accept []byte
	if r.cfg.Pull && r.keys.secure(id) {
		return nil, errPullSecure
	}
	if r.cfg.Pull {
		accept = binary.LittleEndian.AppendUint32([]byte{'K', 'U', version}, uint32(blocks))
	} else {
		var err error
		if accept, err = r.preparePush(id, p); err != nil {
			return nil, err
		}
	}
	r.mu.Lock()
	_, dup := r.prepared[id]
	closed := r.closed
	if !dup && !closed {
		r.prepared[id] = p
	}
	r.mu.Unlock()
	if dup || closed {
		p.release()
		if closed {
			return nil, fmt.Errorf("ucx: prepare: %w", ErrClosed)
		}
		return nil, fmt.Errorf("ucx: prepare: %v already prepared: %w", id, kvlease.ErrInvalidArgument)
	}
	return accept, nil
}

// prepared is a handoff between Prepare and Receive: its block count
// and, in the push model, the worker its messages arrive at and the salt
// of their tags.
type prepared struct {
	blocks int
	w      *worker
	c      *conn // w's connection (the push model)
	salt   uint32
}

// release destroys a prepared worker that will never receive (not
// returned to the pool: the source may have sent to it already).
func (p *prepared) release() {
	if p.c != nil {
		p.c.destroy()
		p.c, p.w = nil, nil
	}
}

// Forget implements handoff.RecvPlane: in the push model it destroys the
// handoff's worker (nothing was received into a region: no transfer; it
// is not kept, since the source may have sent to it).
func (r *Receiver[R]) Forget(id handoff.PlaneID) {
	r.mu.Lock()
	p := r.prepared[id]
	delete(r.prepared, id)
	r.mu.Unlock()
	if p != nil {
		p.release()
	}
}

// start is the parsed Start bytes.
type start struct {
	sizes  []int // the source's piece sizes, one block's
	blocks int
	addr   []byte
	table  []byte     // the run table, when inline
	remote *remoteRun // the run table to read (n is its length), or nil
	regs   []remoteRun
	pieces []remotePiece
}

type reader struct {
	b   []byte
	err error
}

func (r *reader) take(n int) []byte {
	if r.err != nil || n > len(r.b) {
		r.err = fmt.Errorf("ucx: start bytes end early: %w", ErrCorrupt)
		return nil
	}
	out := r.b[:n]
	r.b = r.b[n:]
	return out
}

func (r *reader) u16() int {
	if b := r.take(2); b != nil {
		return int(binary.LittleEndian.Uint16(b))
	}
	return 0
}

func (r *reader) u32() int {
	if b := r.take(4); b != nil {
		return int(binary.LittleEndian.Uint32(b))
	}
	return 0
}

// appendStartHead appends what both models' Start bytes begin with
// (read by startHead), then the block count.
func appendStartHead(b []byte, ver byte, sizes []int, blocks int) []byte {
	b = append(b, 'K', 'U', ver)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(sizes)))
	for _, n := range sizes {
		b = binary.LittleEndian.AppendUint32(b, uint32(n))
	}
	return binary.LittleEndian.AppendUint32(b, uint32(blocks))
}

// startHead reads what both models' Start bytes begin with (written by
// appendStartHead): "KU", the model's version ver, a block's piece count
// and sizes, and the block count, which the caller checks.
func (r *reader) startHead(ver byte) (sizes []int, blocks int, err error) {
	if h := r.take(3); h == nil || h[0] != 'K' || h[1] != 'U' || h[2] != ver {
		return nil, 0, fmt.Errorf("ucx: start bytes: bad header: %w", ErrCorrupt)
	}
	np := r.u16()
	if r.err == nil && (np == 0 || np > maxPieces) {
		return nil, 0, fmt.Errorf("ucx: start bytes: blocks of %d pieces: %w", np, ErrCorrupt)
	}
	sizes = make([]int, np)
	for i := range sizes {
		if sizes[i] = r.u32(); r.err == nil && sizes[i] <= 0 {
			return nil, 0, fmt.Errorf("ucx: start bytes: piece %d of %d bytes: %w", i, sizes[i], ErrCorrupt)
		}
	}
	return sizes, r.u32(), nil
}

func parseStart(b []byte) (*start, error) {
	r := &reader{b: b}
	sizes, blocks, err := r.startHead(version)
	if err != nil {
		return nil, err
	}
	s := &start{sizes: sizes, blocks: blocks}
	s.addr = append([]byte(nil), r.take(r.u16())...)
	mode := r.take(1)
	if r.err != nil {
		return nil, r.err
	}
	if len(s.addr) == 0 || len(s.sizes) == 0 || len(s.sizes) > maxPieces || s.blocks <= 0 || s.blocks > handoff.MaxBlocks {
		return nil, fmt.Errorf("ucx: start bytes: %d blocks of %d pieces, address of %d bytes: %w", s.blocks, len(s.sizes), len(s.addr), ErrCorrupt)
	}
	switch mode[0] {
	case tableInline:
		if len(r.b) == 0 {
			return nil, fmt.Errorf("ucx: start bytes: no run table: %w", ErrCorrupt)
		}
		s.table = r.b
		return s, nil
	case tableRemote:
		t := &remoteRun{addr: r.u64(), n: uint64(r.u32())}
		t.key = append([]byte(nil), r.take(r.u16())...)
		if r.err != nil {
			return nil, r.err
		}
		if len(r.b) != 0 || t.n < 4 || t.n > uint64(maxTable(s.blocks*len(s.sizes))) || len(t.key) == 0 {
			return nil, fmt.Errorf("ucx: start bytes: run table of %d bytes for %d blocks: %w", t.n, s.blocks, ErrCorrupt)
		}
		s.remote = t
		return s, nil
	}
	return nil, fmt.Errorf("ucx: start bytes: table mode %d: %w", mode[0], ErrCorrupt)
}

// recvJob is one handoff being read. Everything but the atomic flags is
// owned by its worker's thread once the job is polled.
type recvJob[R any] struct {
	r       *Receiver[R]
	id      handoff.PlaneID
	w       *worker
	ep      *endpoint
	keys    []*rkey
	memhs   []*memh
	pin     runtime.Pinner
	t       *kvlease.Transfer
	plan    []getOp
	lregs   []run // the destination's registrations (memhs)
	next    int   // gets posted
	inline  int   // gets that completed at once
	b       batch
	fl      op
	flushed bool // the flush is posted
	postErr error
	bytes   int64
	dead    bool      // torn down: step must not touch UCX
	push    *pushRecv // the push model's state, or nil

	canceled atomic.Bool
	once     sync.Once
}

// getOp is one get: n bytes from raddr into local.
type getOp struct {
	block int // of its first byte
	local uintptr
	n     int
	m     int // index into memhs
	raddr uint64
	key   int // index into keys
}

// Receive implements handoff.RecvPlane: it checks the Start bytes against
// the regions (ErrCorrupt, kvlease.ErrInvalidArgument: nothing attached),
// connects to the source's handoff worker, attaches the transfer and
// receives (or, pulled, registers the regions and reads) on the handoff
// worker's thread. The transfer resolves as the package doc says.
func (r *Receiver[R]) Receive(id handoff.PlaneID, regions []R, startBytes []byte, attach func(*kvlease.Transfer) error) error {
	r.mu.Lock()
	p, ok := r.prepared[id]
	delete(r.prepared, id)
	closed := r.closed
	r.mu.Unlock()
	if !ok {
		return fmt.Errorf("ucx: receive: %v not prepared: %w", id, kvlease.ErrInvalidArgument)
	}
	if closed {
		p.release()
		return fmt.Errorf("ucx: receive: %w", ErrClosed)
	}
	if !r.cfg.Pull {
		return r.receivePush(id, p, regions, startBytes, attach)
	}
	blocks := p.blocks
	st, err := parseStart(startBytes)
	if err != nil {
		return err
	}
	j := &recvJob[R]{r: r, id: id}
	g, err := locate(r.pieces, regions, &j.pin)
	if err != nil {
		j.pin.Unpin()
		return err
	}
	if len(regions) != blocks || st.blocks != blocks {
		j.pin.Unpin()
		return fmt.Errorf("ucx: receive: start describes %d blocks; %d prepared, %d regions: %w",
			st.blocks, blocks, len(regions), ErrCorrupt)
	}
	if err := matchPieces(st.sizes, g.sizes); err != nil {
		j.pin.Unpin()
		return err
	}
	if st.table != nil {
		if st.regs, st.pieces, err = parseTable(st.table, st.blocks, st.sizes); err != nil {
			j.pin.Unpin()
			return err
		}
	}
	if j.lregs, err = registrations(g.spans); err != nil {
		j.pin.Unpin()
		return err
	}
	if j.w, err = r.ctx.newWorker(); err != nil {
		j.pin.Unpin()
		return err
	}
	for _, lr := range j.lregs {
		m, err := r.ctx.memMap(lr.addr, lr.n, lr.mem == CUDA)
		if err != nil {
			j.teardown()
			return err
		}
		r.stats.add(func(st *Stats) { st.Registrations++; st.RegisteredBytes += int64(lr.n) })
		j.memhs = append(j.memhs, m)
	}
	if cerr := j.w.call(func() {
		if j.ep, err = j.w.connect(st.addr); err != nil {
			return
		}
		// Finish the handshake before anything is attached: a flush of
		// the fresh endpoint completes once it is wired up.
		if err = j.w.flushWait(j.ep, r.cfg.ConnectSpins); err != nil {
			return
		}
		if st.remote != nil {
			if st.regs, st.pieces, err = j.readTable(st); err != nil {
				return
			}
		}
		for _, rr := range st.regs {
			k, kerr := j.ep.unpack(rr.key)
			if kerr != nil {
				err = kerr
				return
			}
			j.keys = append(j.keys, k)
		}
	}); cerr != nil {
		err = cerr
	}
	if err != nil {
		j.teardown()
		return err
	}
	j.plan = planGets(st.sizes, st.pieces, g, j.lregs, r.cfg.MaxGet)
	return j.launch(attach, false, j.step)
}

// launch gives the job its transfer, attaches it, enrolls the job and
// hands it to its worker's thread (poll), in both models. A failed attach
// or a Receiver closed meanwhile tears the job down (nothing was read or
// received: evidence) and frees the push model's state; keyed counts the
// handoff in Stats.Keyed.
func (j *recvJob[R]) launch(attach func(*kvlease.Transfer) error, keyed bool, poll func() bool) error {
	r := j.r
	drop := func() {
		j.teardown()
		if j.push != nil {
			j.push.free()
		}
	}
	j.t = kvlease.NewTransfer(func() {
		j.canceled.Store(true)
		j.w.do(func() {}) // wake the worker
	})
	if err := attach(j.t); err != nil {
		drop()
		j.t.Resolve(err)
		return err
	}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		drop()
		j.t.Resolve(fmt.Errorf("ucx: receive: %w", ErrClosed))
		return nil
	}
	r.jobs[j] = struct{}{}
	r.wg.Add(1)
	r.mu.Unlock()
	r.stats.add(func(s *Stats) {
		s.Started++
		if keyed {
			s.Keyed++
		}
	})
	if j.push == nil {
		j.b, j.fl = newBatch(), newOp() // the pull model's gets and flush
	}
	if !j.w.do(func() { j.w.pollers = append(j.w.pollers, poll) }) {
		go j.finish(fmt.Errorf("ucx: receive: %w", errWorkerGone), true)
	}
	return nil
}

// readTable reads the source's run table (before anything is attached:
// into C memory of ours, not into a region). Worker thread only.
func (j *recvJob[R]) readTable(st *start) ([]remoteRun, []remotePiece, error) {
	k, err := j.ep.unpack(st.remote.key)
	if err != nil {
		return nil, nil, err
	}
	buf := newCbuf(int(st.remote.n))
	done, err := j.w.getWait(j.ep, buf, st.remote.addr, k, j.r.cfg.ConnectSpins)
	if !done {
		return nil, nil, err // the get may still use buf and the key: both stay allocated
	}
	k.destroy()
	defer buf.free()
	if err != nil {
		return nil, nil, err
	}
	return parseTable(buf.bytes(), st.blocks, st.sizes)
}

// step advances the job on its worker's thread; true when it is done.
func (j *recvJob[R]) step() bool {
	if j.dead {
		return true
	}
	if err := j.ep.failed(); err != nil {
		// The peer is gone: UCX completes what was outstanding without
		// the peer's word. Not evidence: revoke.
		go j.finish(fmt.Errorf("%w: %w", err, ErrRevoked), true)
		return true
	}
	completed := j.inline + j.b.completed()
	stopping := j.canceled.Load() || j.postErr != nil || j.b.failedN() > 0
	for !stopping && j.next < len(j.plan) && j.next-completed < j.r.cfg.Window {
		g := j.plan[j.next]
		if hook := j.r.cfg.BeforeGet; hook != nil {
			hook(j.id, g.block)
			if j.canceled.Load() {
				stopping = true
				break
			}
		}
		done, err := j.ep.get(g.local, g.n, j.memhs[g.m], g.raddr, j.keys[g.key], j.b)
		if err != nil {
			j.postErr = err
			stopping = true
			break
		}
		j.next++
		if done {
			j.inline++
			completed++
		}
	}
	if completed < j.next {
		return false // wait for the posted gets
	}
	if !j.flushed && (stopping || j.next == len(j.plan)) {
		j.flushed = true
		if _, err := j.ep.flush(j.fl); err != nil {
			go j.finish(fmt.Errorf("%w: %w", err, ErrRevoked), true)
			return true
		}
	}
	if !j.flushed || !j.fl.done() {
		return false
	}
	if err := j.fl.err(); err != nil {
		// A flush that failed proves nothing: revoke.
		go j.finish(fmt.Errorf("ucx: flush: %w: %w", err, ErrRevoked), true)
		return true
	}
	// Every posted get completed and a flush after them completed:
	// evidence. The outcome says whether every block arrived.
	var out error
	switch {
	case j.b.failedN() > 0:
		out = fmt.Errorf("ucx: %d of %d gets failed: %w", j.b.failedN(), j.next, j.b.firstErr())
	case j.postErr != nil:
		out = j.postErr
	case j.next < len(j.plan):
		out = fmt.Errorf("ucx: stopped after %d of %d gets: %w", j.next, len(j.plan), kvlease.ErrCanceled)
	default:
		for _, g := range j.plan {
			j.bytes += int64(g.n)
		}
	}
	go j.finish(out, false)
	return true
}

// teardown releases the job's UCX resources: remote keys and the
// endpoint (forced close: only after the flush's evidence or as part of
// a revocation), the worker, the destination's registrations.
func (j *recvJob[R]) teardown() {
	if j.push != nil && j.push.prep.c != nil {
		c := j.push.prep.c
		c.w.destroy(func() {
			j.dead = true
			if c.ep != nil {
				_ = c.w.closeEP(c.ep, true)
				c.ep, j.ep = nil, nil
			}
			c.w.settle() // the source connected to this worker
		})
	} else if j.w != nil {
		j.w.destroy(func() {
			j.dead = true
			for _, k := range j.keys {
				k.destroy()
			}
			j.keys = nil
			if j.ep != nil {
				_ = j.w.closeEP(j.ep, true)
				j.ep = nil
			}
			if j.push != nil {
				j.w.settle() // the source connected to this worker
			}
		})
	}
	for _, m := range j.memhs {
		_ = j.r.ctx.unmap(m)
	}
	j.memhs = nil
	j.pin.Unpin()
}

// finish tears the job down and resolves its transfer, once. revoked
// says the evidence is the teardown itself.
func (j *recvJob[R]) finish(out error, revoked bool) {
	j.once.Do(func() {
		if j.push != nil && j.push.stray {
			j.r.stats.add(func(s *Stats) { s.Strays++ })
		}
		if out == nil && !revoked && j.push != nil && j.push.prep.c != nil && !j.push.stray {
			// Every receive completed and every block passed its check:
			// the worker and its endpoint serve the session's next
			// handoff (a new salt, so none of this one's tags).
			j.pin.Unpin()
			j.r.pool.put(keyOf(j.id), j.push.prep.c)
		} else {
			j.teardown()
		}
		j.b.free()
		j.fl.free()
		j.r.mu.Lock()
		delete(j.r.jobs, j)
		j.r.mu.Unlock()
		if j.push != nil {
			j.push.free()
		}
		j.r.stats.add(func(s *Stats) {
			if j.push != nil {
				s.Messages += j.next
			} else {
				s.Gets += j.next
			}
			switch {
			case revoked:
				s.Revoked++
			case out == nil:
				s.Completed++
				s.Bytes += j.bytes
			case errors.Is(out, kvlease.ErrCanceled):
				s.Canceled++
			}
		})
		j.t.Resolve(out)
		j.r.wg.Done()
	})
}

// Stats returns what the receiver did.
func (r *Receiver[R]) Stats() Stats {
	st := r.stats.get()
	st.Idle = r.pool.idleN()
	return st
}

// Close revokes every handoff still reading (the operator's way out of a
// silent source: each job's endpoint is closed, its worker destroyed and
// its registrations unmapped, and that is its evidence), destroys the
// idle workers and releases UCX. Closing again does nothing.
func (r *Receiver[R]) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil // closed already (UCX is released once)
	}
	r.closed = true
	all := make([]*recvJob[R], 0, len(r.jobs))
	for j := range r.jobs {
		all = append(all, j)
	}
	preps := make([]*prepared, 0, len(r.prepared))
	for id, p := range r.prepared {
		preps = append(preps, p)
		delete(r.prepared, id)
	}
	r.mu.Unlock()
	for _, p := range preps {
		p.release()
	}
	for _, j := range all {
		j.finish(fmt.Errorf("%w: %w", ErrClosed, ErrRevoked), true)
	}
	r.wg.Wait()
	r.pool.close()
	r.ctx.close()
	return nil
}
