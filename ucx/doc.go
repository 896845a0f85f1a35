// Package ucx is a data plane for cross-process handoffs (package
// handoff) over UCX, the communication engine that drives InfiniBand,
// RoCE, NVLink, GPUDirect and plain TCP. It lives in its own Go module
// (github.com/kvlease/kvlease/ucx) because it needs cgo and the UCX
// libraries (Debian: apt-get install libucx-dev; UCX ≥ 1.13); the root
// module stays pure Go. The cgo layer is this package's own: the few UCP
// calls a pull transfer needs (the public Go bindings lack remote memory
// access on 1.13).
//
// Sender implements handoff.SendPlane on the source (prefill) side,
// Receiver handoff.RecvPlane on the destination (decode) side. UCX reads
// its usual environment (UCX_TLS, UCX_NET_DEVICES, ...): the tests run
// UCX_TLS=tcp on lo.
//
// # Pull model
//
// The destination reads; the source only exposes. A block is a list of
// pieces (Span): a plain block is one piece, a block of per-layer KV its
// Layers·KVs pieces in (layer, kv) order (see Layered blocks). For each
// handoff the source starts a UCX worker of the handoff's own, registers
// the handoff's pieces with ucp_mem_map (one registration per contiguous
// run of them, this handoff's alone: revoking it revokes nothing else,
// and nothing outside the pieces is registered), packs a remote key per
// run (ucp_rkey_pack) and sends, in the Start message's plane bytes, the
// worker's address, the piece sizes of a block, each run's address,
// length and key, and the segments: where the pieces lie, as maximal
// contiguous stretches in block or piece order (omitted when they are the
// runs themselves, as for a contiguous lease). The destination starts a
// worker of its own, connects to the source's (ucp_ep_create with peer
// error handling; a flush of the fresh endpoint completes the handshake
// before anything is attached), unpacks the keys (ucp_ep_rkey_unpack),
// registers its own pieces the same way, and reads with ucp_get_nbx —
// what is contiguous on both sides with one get, up to Config.MaxGet,
// Config.Window gets outstanding — then flushes the endpoint
// (ucp_ep_flush_nbx). The Accept bytes carry only the block count.
//
// Every UCX call on a worker, its endpoints and its requests runs on one
// goroutine locked to its OS thread (UCS_THREAD_MODE_SINGLE), which also
// runs the completion callbacks inside ucp_worker_progress and sleeps on
// the worker's event fd when idle. Registrations are made on the shared
// context (created with mt_workers_shared).
//
// # Evidence
//
// What resolves each side's kvlease.Transfer, and which UCX call carries
// it:
//
//   - Destination (Write): resolves when every get it posted has
//     completed (ucp_get_nbx's callback) and a flush of the endpoint
//     posted after them has completed (ucp_ep_flush_nbx's callback, with
//     UCS_OK). The outcome is nil when every block arrived, ErrCanceled
//     when a cancel stopped it before its last get (the flush still
//     covers the posted ones), the first failed get otherwise.
//   - Source (Read): resolves on the destination's done without error —
//     the Done message, which the destination sends only after that
//     flush (Finish with a nil peer) — after the registration is revoked;
//     if the destination reported an error, aborted, went silent past the
//     deadline (the cancel) or lost its control connection, the source
//     revokes and the revocation is its evidence (outcome wraps
//     ErrRevoked).
//   - Revocation is ucp_mem_unmap of each of the handoff's registrations
//     (a hardware transport's remote key stops working) and
//     ucp_worker_destroy of the handoff's worker (with UCX_TLS=tcp, UCX
//     emulates the get in software: the source's worker serves it from
//     its progress loop, which never runs again). Only after both does
//     the transfer resolve.
//   - Not evidence: a get that completed with an error, a failed flush,
//     an endpoint error (UCX completes outstanding requests with an error
//     or as cancelled without the peer's confirmation), a forced endpoint
//     close, a cancel. A destination in that state revokes its own side
//     (forced close of the endpoint, ucp_worker_destroy of its handoff
//     worker, ucp_mem_unmap of its registrations), and that is its
//     evidence. A destination whose source is alive but silent (a
//     stopped process: its gets and its flush neither complete nor fail)
//     has nothing: its cancel is a request, its blocks stay draining and
//     then quarantined, until the source resumes (the gets and the flush
//     complete: late evidence), the connection fails (revocation), or the
//     operator calls Close (revocation of everything still reading).
//
// # Layered blocks
//
// NewLayeredSender and NewLayeredReceiver take regions that are blocks of
// per-layer KV in host memory (LayeredRegion: layout.Block over a
// layout.Host, gpu.HostBlock over a gpu.LayeredPinned); NewSenderOfPieces
// and NewReceiverOfPieces take any region type with a function that lists
// its pieces (device memory: Spans with Memory CUDA). A block moves as all
// its pieces, and a handoff is still one Transfer per side, with the same
// evidence:
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
// The Start bytes carry the run table inline while it fits
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
// plane therefore finishes the handshake before attaching, and flushes a
// source worker (bounded) before destroying it; when that flush cannot
// complete, the worker is abandoned instead: never progressed again (so
// it serves no get: the revocation holds), never freed (Abandoned counts
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
// device path is untested here: the tests cover host memory only.
package ucx
