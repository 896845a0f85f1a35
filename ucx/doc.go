// Package ucx is a data plane for cross-process handoffs (package
// handoff) over UCX, the communication engine that drives InfiniBand,
// RoCE, NVLink, GPUDirect and plain TCP. It lives in its own Go module
// (github.com/kvlease/kvlease/ucx) because it needs cgo and the UCX
// libraries (Debian: apt-get install libucx-dev; UCX ≥ 1.13); the root
// module stays pure Go. The cgo layer is this package's own: the few UCP
// calls a transfer needs (the public Go bindings lack remote memory
// access on 1.13).
//
// Sender implements handoff.SendPlane on the source (prefill) side,
// Receiver handoff.RecvPlane on the destination (decode) side. UCX reads
// its usual environment (UCX_TLS, UCX_NET_DEVICES, ...): the tests run
// UCX_TLS=tcp on lo.
//
// # Push model (the default)
//
// The source sends; the destination receives into its own pieces and
// exposes nothing. A block is a list of pieces (Span): a plain block is
// one piece, a block of per-layer KV its Layers·KVs pieces in (layer, kv)
// order (see Layered blocks). For each handoff the destination's Prepare
// takes a UCX worker for the handoff alone — an idle one of the session
// or a new one (see Connections) — and puts its address and a tag salt
// new on that worker in the Accept bytes. The source's Send takes its
// idle endpoint to that worker, or connects to it from a worker of its
// own (a flush of the fresh endpoint completes the handshake before
// anything is attached), and returns, in the Start bytes, the piece sizes of a block, the block
// count, the integrity mode, a random nonce, its worker's address, the
// most blocks of one message and its runs (see Runs); then, from its
// worker's thread, it sends each run as one tagged message and each
// other block as one (ucp_tag_send_nbx with the tag salt·2³²+first
// block, gathered from the pieces with an iov datatype when they are
// not one buffer; at most Config.Window outstanding), and after the last
// a table of the blocks' integrity sums. The destination's Receive
// connects to the source's worker (only to hear of its failure: peer
// error handling), attaches, and posts one receive per message with its
// exact tag into the message's blocks' own pieces (ucp_tag_recv_nbx; one
// buffer where they are adjacent in the destination's memory, scattered
// with an iov datatype otherwise; Config.Window outstanding), and one
// for the sums table. A message lands only where the destination put it:
// a message of another tag waits in UCX's unexpected queue (UCX memory,
// never a region) and is dropped with the worker (a worker found holding
// one at a handoff's end is not kept: Stats.Strays); a longer one is
// truncated and fails, a shorter one fails its length check.
//
// Both contexts of the push model are created without UCP_FEATURE_RMA,
// so neither side's worker serves a get or a put: UCX installs its
// software emulation of remote memory access (the handlers a get over
// tcp reaches) only for that feature. The destination never names an
// address of the source.
//
// Integrity: once every block and the table arrived, the destination
// checks each block against its sum before the transfer resolves nil;
// a block that fails resolves the transfer with an error wrapping
// ErrCorrupt (the handoff fails; nothing is sealed). The sums are keyed
// when the control session is authenticated (IntegrityMAC: a GMAC,
// AES-256-GCM, per block, under a key derived with HKDF-SHA256 from the
// session's key for this handoff alone — its id, the source's nonce and
// the destination's salt are mixed in — with the block index in each
// nonce), and crc32c otherwise (IntegrityCRC: the insecure mode's check,
// against corruption, not forgery). The source picks the mode and holds
// the key, so the destination does not take its word: with a session key
// it refuses any mode but the keyed MAC (none, crc32c) for every region
// kind (plain blocks, pieces, streamed), and without one it refuses
// keyed sums, before anything is attached. Device memory (Memory CUDA)
// cannot be summed (the CPU cannot read it): an insecure session moves
// it unchecked (IntegrityNone), an authenticated one refuses it on
// either side (kvlease.ErrInvalidArgument) rather than let blocks in
// unchecked.
//
// # Connections
//
// Pushed, a handoff to a peer already connected costs no worker and no
// handshake. Each side keeps, per control session (its local number and
// its authenticated handoff.Peer: a worker, and its address, serve one
// session only), up to Config.MaxIdle idle connections: the
// destination's workers, the source's workers each with its endpoint to
// a destination worker. A connection serves one handoff at a time, from
// Prepare (destination) or Send (source) to that handoff's end, and goes
// back to its session's idle list only if the handoff ended cleanly on
// that side:
//
//   - destination: every receive it posted completed, every block
//     passed its check (the transfer resolves nil), its endpoint to the
//     source did not fail, and no message nobody asked for waits in the
//     worker (ucp_tag_probe_nb);
//   - source: the destination's done without error, and every send of
//     the handoff completed (each message's and the table's completion
//     callback ran: UCX is done with the regions).
//
// Any other end — a cancel, an abort, a corrupt block, a failed
// endpoint, a source silent past its deadline, Close — destroys the
// connection exactly as a worker per handoff was destroyed before (the
// revocations of Evidence), so nothing of a handoff that ended badly
// reaches a later one through it: a late message of an aborted handoff
// goes to a worker that no longer exists. Every handoff still draws its
// own salt (the destination worker's is random at its creation, then
// one more per handoff, so no two handoffs of a worker share a tag), its
// own nonce and its own MAC key: a late message of an earlier handoff on
// a reused worker never matches this handoff's receives (and would fail
// its MAC if it were taken), and is then found by the probe at the end.
//
// The destination's Receive reuses its worker's endpoint to the source's
// worker when the Start bytes name the same one. A source that has no
// idle endpoint to the worker the destination named (the two sides keep
// and expire their idle connections independently) connects an idle
// worker of the session to it, closing its old endpoint (Stats.Connects,
// no new worker). An endpoint found failed when a handoff takes it, or
// by the sweep of idle connections, is destroyed (Stats.Broken) and the
// handoff connects afresh: a broken endpoint fails only the handoff that
// was using it (by the evidence rules below), never one that comes after.
//
// Idle connections are destroyed after Config.IdleTimeout (Stats.Expired;
// 30 s on a Sender, 60 s on a Receiver by default: the destination keeps
// a worker longer than the source keeps its endpoint to it, so the
// source drops its end first and the destination never destroys a worker
// a source is about to reuse), beyond MaxIdle per session (the oldest),
// and by Close. Config.MaxIdle -1 keeps none: a worker and a connect per
// handoff on each side. Stats counts Workers, Connects, Reuses, Expired,
// Broken and Strays, and Idle the connections idle now.
//
// The pull model keeps a worker per handoff on each side: its revocation
// is the destruction of the source's worker (which serves the emulated
// gets of UCX_TLS=tcp from its progress loop), so that worker cannot
// outlive the handoff.
//
// # Pull model (Config.Pull)
//
// With Config.Pull on both sides the destination reads; the source only
// exposes. For each handoff the source starts a UCX worker of the
// handoff's own, registers the handoff's pieces with ucp_mem_map (one
// registration per contiguous run of them, this handoff's alone: revoking
// it revokes nothing else, and nothing outside the pieces is
// registered), packs a remote key per run (ucp_rkey_pack) and sends, in
// the Start message's plane bytes, the worker's address, the piece sizes
// of a block, each run's address, length and key, and the segments:
// where the pieces lie, as maximal contiguous stretches in block or
// piece order (omitted when they are the runs themselves, as for a
// contiguous lease). The destination starts a worker of its own,
// connects to the source's (ucp_ep_create with peer error handling; a
// flush of the fresh endpoint completes the handshake before anything is
// attached), unpacks the keys (ucp_ep_rkey_unpack), registers its own
// pieces the same way, and reads with ucp_get_nbx — what is contiguous on
// both sides with one get, up to Config.MaxGet, Config.Window gets
// outstanding — then flushes the endpoint (ucp_ep_flush_nbx). The Accept
// bytes carry only the block count. A sender refuses the other model's
// Accept bytes (ErrCorrupt): a destination cannot talk a pushing source
// into exposing its memory.
//
// Pull trusts the destination with the whole source process: see Trust.
//
// # Runs
//
// Moving KV costs per descriptor more than per byte, and a lease's fresh
// blocks come as few runs of consecutive block ids as the pool's free
// space allows (kvlease.Lease.AppendRuns). On this plane a run is a
// stretch of consecutive blocks of a handoff that lie one after the
// other in memory (each block's pieces, block by block, adjacent and of
// one memory type): block i+1 starts where block i ends. Consecutive ids
// of a kvlease.HostMemory or an arena are such a run; a layer-separated
// layout's blocks are not (their pieces of one layer and kind are, which
// the pull model's registrations and gets merge).
//
//   - Push: a run of the source's is one message, cut at
//     max(1, min(source's, destination's Config.MaxGet) / block bytes)
//     blocks (the destination's bound travels in its Accept bytes; a
//     source that exceeds it is refused with ErrCorrupt before anything
//     is attached). The Start bytes list the runs of two blocks or more
//     (their first block and count, 8 bytes each); when they do not all
//     fit handoff.MaxPlane, the longest that fit are listed and the
//     blocks of the others move one message each. Both sides cut the
//     same messages from that list. The destination need not hold the
//     run adjacently: it scatters the message into its blocks. Nothing
//     is registered with ucp_mem_map (UCX registers, through its own
//     cache, what a zero-copy protocol needs, per message). Stats.Messages
//     counts the messages: 256 adjacent blocks of 4 KiB are one message,
//     the same blocks scattered 256.
//   - Pull: each side registers one ucp_mem_map (and the source packs one
//     remote key) per run of its pieces sorted by address, and the
//     destination reads what is adjacent on both sides with one get, up
//     to Config.MaxGet. Stats.Registrations and Stats.Gets count them:
//     256 adjacent blocks of 4 KiB are one registration a side and one
//     get, scattered 256 of each.
//
// The integrity sums stay per block (the table, the keys and the nonces
// are as without runs): a block moved inside its run's message, or a
// message cut differently from the list, fails the destination's length
// or sum check (ErrCorrupt). The evidence rules are unchanged: a run's
// message or get is one of the receives or gets the destination waits
// for; a cancel withdraws the receives not yet matched, so Config.MaxGet
// also bounds what a matched receive holds back after a cancel.
//
// Every UCX call on a worker, its endpoints and its requests runs on one
// goroutine locked to its OS thread (UCS_THREAD_MODE_SINGLE), which also
// runs the completion callbacks inside ucp_worker_progress and sleeps on
// the worker's event fd when idle (the endpoint's failure flag, which
// UCX's error handler sets, is read atomically from any thread: taking a
// kept connection costs no hop to its thread). Registrations are made on the shared
// context (created with mt_workers_shared).
//
// # Streaming
//
// Pushed, a Sender is a handoff.StreamSendPlane: a streaming handoff
// (handoff.Streaming) may start before the prefill has written its
// blocks, and SendStream returns the Start bytes at once (they carry
// version 5 and the layer count; a destination of an older version
// refuses them as ErrCorrupt). A block's layer j is the j-th of Layers
// equal slices of the block in its contiguous form (a layered block's
// pieces of layer j, K then V), and each message of Runs travels as one
// tagged message per layer: layer j of each of its blocks, gathered from
// (and scattered into) each side's own pieces with an iov datatype, one
// buffer where the slices are adjacent. The destination posts the
// receives of every (message, layer) at once (a handoff has at most 2¹⁸
// of them, refused beyond with kvlease.ErrExceedsCapacity before
// anything is sent), so the source sends them in whatever order the
// prefill marks them (handoff.Progress: layer by layer, or whole blocks
// front to back). The source's worker posts (message, layer) only once
// the progress says that layer of every block of the message is written
// (at most Config.Window outstanding) and never reads a part before; a
// goroutine of the handoff waits on the progress (handoff.Ready.Wait)
// and wakes the worker at each mark, until the progress is complete or
// the handoff ends (a cancel, Finish, Close). The destination checks
// every block's sum, as without streaming, before its Write resolves.
// Keyed, a streamed block's sum is a GMAC of its layers' GMACs (the
// summer's units are the layers, the same on both sides whatever their
// pieces), and each side computes a layer's GMAC as soon as it may read
// that layer: the source when it posts the layer's message, the
// destination when that receive completed; the last layer then costs
// its own share, not the whole handoff's. (crc32c sums, and a handoff of
// more than 2²⁰ (block, layer) pairs, are computed over whole blocks:
// the source's when a message's last layer is posted, the destination's
// at the end.) The handoff holds its connection for its whole prefill, and
// it goes back to the idle list as any other (TestStreamReusesConnection).
//
// The evidence rules are unchanged. A cancel stops a waiting sender as a
// sending one (the revocation); the destination's cancel withdraws its
// receives. A source's abort revokes its worker at once, while the abort
// itself travels on the control connection: a streaming destination that
// sees the source's endpoint fail first withdraws its receives and, once
// every one is done (its evidence), waits up to 2 s for its own cancel
// before it resolves as the abort says (canceled) or, past it, as
// revoked. Parts the destination already has stay; the outcome is not
// nil, so nothing is sealed.
//
// The pull model does not stream: its destination reads as soon as it
// has the Start bytes, so a pulling Sender's SendStream waits until the
// progress is complete (or Close) and then behaves as Send — the handoff
// starts after the prefill, as the handoff package's fallback for a plane
// that cannot stream. BenchmarkStream measures the time from the
// prefill's last mark to Delivered, streaming against start-after-prefill
// and against one layer's share sent alone as a handoff, in the same run
// (4 MiB in 32 layers of 1 ms, PSK, one run, UCX_TLS=tcp on loopback on
// a noisy 2-core VM, 20 iterations, two runs): streaming 0.97–1.0 ms,
// start-after-prefill 4.6–5.2 ms, one layer 1.3–1.6 ms (stream/layer
// 0.64–0.75).
//
// # Evidence
//
// What resolves each side's kvlease.Transfer, and which UCX call carries
// it:
//
//   - Destination, push: resolves when every receive it posted has
//     completed (ucp_tag_recv_nbx's callback): its message landed, or a
//     cancel withdrew it before a message matched (ucp_request_cancel:
//     the receive completes with UCS_ERR_CANCELED and UCX never writes
//     its buffer). The outcome is nil when every block arrived and passed
//     its check, kvlease.ErrCanceled when a cancel stopped it, an error wrapping
//     ErrCorrupt for a message of the wrong length or a block of the
//     wrong sum. A receive that
//     a message already matched is not withdrawn: a source stopped in
//     the middle of one leaves the transfer pending (quarantine), until
//     it resumes, fails (the endpoint's error: revocation) or Close.
//   - Destination, pull: resolves when every get it posted has
//     completed (ucp_get_nbx's callback) and a flush of the endpoint
//     posted after them has completed (ucp_ep_flush_nbx's callback, with
//     UCS_OK). The outcome is nil when every block arrived, kvlease.ErrCanceled
//     when a cancel stopped it before its last get (the flush still
//     covers the posted ones), the first failed get otherwise.
//   - Source, pull: resolves on the destination's done without error —
//     the Done message, which the destination sends only after its own
//     evidence (Finish with a nil peer) — after the revocation.
//   - Source, push: resolves on the destination's done without error
//     once every send the handoff posted has completed (its completion
//     callback: UCX is done with the buffer; the connection is kept, see
//     Connections); if they have not within 5 s, or the endpoint failed,
//     after the revocation instead.
//   - Source (both models): if the destination reported an error,
//     aborted, went silent past the deadline (the cancel) or lost its
//     control connection, the source revokes and the revocation is its
//     evidence (outcome wraps ErrRevoked). A revoked push source posts no
//     further message from then on, even before its worker is destroyed.
//   - Revocation is ucp_worker_destroy of the worker the handoff holds
//     (its own, or a kept connection's, which serves no other handoff
//     meanwhile; after a forced close of its endpoint, push: whatever is
//     still being sent stops, and nothing of UCX reads the regions any
//     more) and, pull,
//     ucp_mem_unmap of each of the handoff's registrations (a hardware
//     transport's remote key stops working; with UCX_TLS=tcp, UCX
//     emulates the get in software: the source's worker serves it from
//     its progress loop, which never runs again). Only after both does
//     the transfer resolve.
//   - Not evidence: a get or a receive that completed with an error
//     because the endpoint failed, a failed flush, an endpoint error
//     (UCX completes outstanding requests with an error or as cancelled
//     without the peer's confirmation), a forced endpoint close, a
//     cancel. A destination in that state revokes its own side (forced
//     close of the endpoint, ucp_worker_destroy of the worker it holds,
//     ucp_mem_unmap of its registrations), and that is its evidence. A
//     destination whose source is alive but silent (a stopped process:
//     its gets and its flush, or a matched receive, neither complete nor
//     fail) has nothing: its cancel is a request, its blocks stay
//     draining and then quarantined, until the source resumes (late
//     evidence), the connection fails (revocation), or the operator calls
//     Close (revocation of everything still reading).
//
// # Trust
//
// What crosses between the processes, and what each side exposes:
//
//   - The worker addresses, the tag salt, the nonce and (pull) the
//     remote keys travel only in the Accept and Start messages' plane
//     bytes, inside the handoff's control session: authenticated and
//     MACed when the halves are configured with an authenticator (the
//     handoff package's default), in the clear with Insecure. The plane
//     opens no channel of its own besides UCX's.
//   - Push (the default): the source's worker serves nothing (no
//     UCP_FEATURE_RMA): a destination that asks it for any address — its
//     own blocks shifted, another request's block of the same pool —
//     gets nothing (TestPushExposesNothing, and across processes, with
//     an authenticated hostile destination, TestProcsHostileDestination).
//     The source sends only the handoff's pieces, from addresses of its
//     own regions.
//   - Pull: UCX 1.13 emulates a get in software when the remote key
//     names no registration that a hardware transport can check (always
//     over tcp; on any transport for a key the destination crafts), and
//     the source's worker then serves any address of the source process,
//     for gets and for puts alike (rma_sw.c's handlers copy from and to
//     the requested address;
//     TestPullTrustsTheDestination reads another request's block this
//     way). Which transports the endpoint uses cannot make pull safe:
//     the handler is installed for the feature, not per transport. So
//     pull is opt-in (Config.Pull) for a destination trusted with the
//     source process's memory, and a pushing sender refuses a
//     destination that asks to pull.
//   - Integrity: with an authenticated session each block is MACed under
//     the session (IntegrityMAC): a block injected by anyone who does not
//     hold the session key, or taken from another handoff or session, or
//     moved within the handoff, fails its check and the handoff fails.
//   - The trust boundary: UCX authenticates nobody. A process that can
//     reach a worker's transport (over tcp, its listening port) can
//     connect to it without the control session; the plane's defences
//     against it are that the push model's workers serve no remote
//     memory access and that the destination checks every block's MAC.
//     UCX's tcp transport itself honours a raw put request from a peer
//     connected at its level (uct_tcp_ep_handle_put_req writes where the
//     request says), which no configuration of ours turns off: run UCX
//     over tcp only where the peers that can reach the workers are
//     trusted, or use the root module's TCP plane, which authenticates
//     its data connections. Such a process can also fill a destination
//     worker's unexpected-message queue (UCX memory, until the worker is
//     destroyed: at the end of the handoff that finds a message there,
//     or when it fails, expires or the plane closes; a kept worker lives
//     across handoffs of its session). An authenticated peer can still
//     send wrong but well-formed KV.
//
// # Layered blocks
//
// NewLayeredSender and NewLayeredReceiver take regions that are blocks of
// per-layer KV in host memory (LayeredRegion: layout.Block over a
// layout.Host, gpu.HostBlock over a gpu.LayeredPinned); NewSenderOfPieces
// and NewReceiverOfPieces take any region type with a function that lists
// its pieces (device memory: Spans with Memory CUDA). A block moves as all
// its pieces, and a handoff is still one Transfer per side, with the same
// evidence. Pushed, a block is one message whatever the pieces (gathered
// and scattered by UCX's iov datatype), and a run of blocks one message
// where the source's blocks are each one stretch of memory (the
// contiguous layout; see Runs). Pulled:
//
//   - registrations: in a layer-separated layout ([layers][K, V][blocks]
//     [piece]) the pieces of consecutive blocks in one layer and kind are
//     adjacent, so a lease of r stretches of consecutive blocks registers
//     r·Layers·KVs runs; a contiguous layout registers r (Stats counts
//     them and their bytes, which are exactly the pieces');
//   - gets: each destination piece reads the source bytes at the same
//     offset of the block in piece order; pieces adjacent on both sides
//     share a get (both layer-separated: one get per layer and kind per
//     stretch of blocks consecutive on both sides; both contiguous: one
//     per stretch of blocks), otherwise one get per piece.
//
// The two sides may lay memory out differently (strides, layer-separated
// or contiguous), but their pieces must agree: the same number of pieces
// of the same sizes, or one side a single piece of the whole block (a
// plain []byte block holds a layered block's pieces one after the other,
// as the contiguous layout does, so the contiguous planes and the layered
// ones interoperate). Anything else is refused with ErrCorrupt before the
// destination registers, connects or attaches. That the pieces mean the
// same (layers, kinds, element type) is the envelope's Layout, compared at
// propose time; regions of one side that disagree among themselves (or
// overlap) are refused with kvlease.ErrInvalidArgument before anything is
// registered.
//
// # Limits
//
// Pushed, the Start bytes hold a block's piece sizes (4 bytes each), the
// source worker's address and as many runs as fit (8 bytes each): a
// lease's fragmentation costs messages, never a refusal; the sums table
// is blocks·16 bytes (keyed) or blocks·4 (crc32c). A source
// may send before the destination posts its receives: those messages
// wait in the destination's UCX memory (bounded by the handoff, which
// the destination accepted). A prepared handoff holds its worker (an OS
// thread and a listening socket) until its Start or its Forget (which
// destroys it: the source may have sent to it): the handoff package's
// per-session caps and start timeout bound how many. An idle connection
// holds the same (the source's: a thread and its endpoint's sockets),
// at most Config.MaxIdle per session until Config.IdleTimeout.
// Pulled, the Start bytes carry the run table inline while it fits
// handoff.MaxPlane (4096): with UCX_TLS=tcp a worker address takes about
// 50 bytes and each run 28 (a 10-byte key), so about 140 runs when the
// segments are the runs (a contiguous lease in block order, a
// layer-separated one in piece order), fewer when the segments are
// listed (16 bytes each). A handoff with more (a fragmented lease of a
// long context) registers a copy of the table in C memory with the
// handoff and sends its address, length and key instead; the destination
// reads it with one get before anything is attached. A block has at most
// 512 pieces.
//
// UCX 1.13 aborts the process when ucp_worker_destroy purges a wireup
// reply that is still pending (the peer stopped before taking it). The
// plane therefore finishes the source's handshake before attaching, and
// flushes a handoff worker (bounded) before destroying it (the push
// destination does not wait for its endpoint to the source: that
// endpoint only reports the source's failure); when that flush cannot
// complete, the worker is abandoned instead: never progressed again (so
// it serves nothing: the revocation holds), never freed (Abandoned counts
// them; each keeps a few sockets until the process exits).
//
// # Device memory
//
// NewSenderOf and NewReceiverOf take a locator from the region type to a
// Span; a Span with Memory CUDA is registered with
// UCS_MEMORY_TYPE_CUDA in ucp_mem_map's memory_type, the rest of the path
// is the same. For a pool over a gpu.DeviceArena:
//
//	arena := ... // *gpu.DeviceArena, blocks of bb bytes
//	loc := func(p gpu.DevicePtr) ucx.Span {
//		return ucx.Span{Addr: uintptr(p), Len: bb, Memory: ucx.CUDA}
//	}
//	sender, err := ucx.NewSenderOf(ucx.Config{}, loc)     // SendPlane[gpu.DevicePtr]
//	receiver, err := ucx.NewReceiverOf(ucx.Config{}, loc) // RecvPlane[gpu.DevicePtr]
//
// A gpu.LayeredDevice's blocks list their pieces the same way:
//
//	pieces := func(b gpu.DeviceBlock, dst []ucx.Span) []ucx.Span {
//		lay := b.M.Layout()
//		for l := range lay.Layers {
//			for kv := range lay.KVs {
//				p := b.M.Piece(b.ID, l, kv)
//				dst = append(dst, ucx.Span{Addr: uintptr(p), Len: lay.PieceBytes, Memory: ucx.CUDA})
//			}
//		}
//		return dst
//	}
//	sender, err := ucx.NewSenderOfPieces(ucx.Config{}, pieces)
//
// A gpu.PinnedArena's regions are []byte and use NewSender as they are.
// This needs a UCX built with CUDA support (ucx_info -d lists cuda_copy
// or cuda_ipc, and GPUDirect RDMA for device-to-device over a NIC).
// Debian's libucx is built without it, and this machine has no GPU, so the
// device path is untested here: the tests cover host memory only. Device
// memory moves only in insecure sessions: an authenticated one needs a
// keyed sum per block, which the CPU cannot compute or check over it
// (see Integrity).
package ucx
