// Package ucx is a data plane for cross-process handoffs (package
// handoff) over UCX, the communication engine that drives InfiniBand,
// RoCE, NVLink, GPUDirect and plain TCP. A Sender is the source
// (prefill) side's handoff.SendPlane, a Receiver the destination
// (decode) side's handoff.RecvPlane: the handoff package runs the control
// session, this package moves the blocks. It is its own Go module
// (github.com/kvlease/kvlease/ucx) because it needs cgo and the UCX
// libraries (Debian: apt-get install libucx-dev; UCX ≥ 1.13); the root
// module stays pure Go. The design, section by section, is in DESIGN.md
// beside this file.
//
// # Using it
//
// Each side makes its plane for its region type and gives it to its
// half of the handoff:
//
//	sender, err := ucx.NewSender(ucx.Config{}, ucx.HostBytes)     // []byte blocks
//	receiver, err := ucx.NewReceiver(ucx.Config{}, ucx.HostBytes)
//
// The second argument says where a region's memory is: a list of
// pieces (Span: address, length, host or CUDA memory), in an order both
// sides agree on. HostBytes makes a []byte block one piece; LayeredPieces
// makes a block of per-layer KV (layout.Block, gpu.HostBlock) its
// (layer, kv) pieces; a function of the caller's can list anything else,
// device memory included. The two sides' pieces must have the same
// sizes, or one side must be a single piece of the whole block.
//
// UCX reads its usual environment (UCX_TLS, UCX_NET_DEVICES, ...); the
// tests run UCX_TLS=tcp on loopback. Config's zero value is usable.
//
// # Push and pull
//
// By default the source pushes: it sends each block (or each run of
// blocks adjacent in its memory) as a tagged message to a worker the
// destination made for the handoff, and the destination receives into
// its own blocks. Neither side exposes memory: no worker of this model
// serves remote memory access. Every block carries a sum the
// destination checks before the transfer resolves: a GMAC under a key
// derived from the control session's when the session is authenticated,
// crc32c when it is not. Config.Pull selects the other model, in which
// the destination reads the source's registered memory: it trusts the
// destination with the whole source process (see Caveats) and refuses
// authenticated sessions.
//
// # Evidence
//
// A kvlease.Transfer resolves only when nothing of UCX in this process
// will touch its regions any more:
//
//   - destination: every receive (push) or get and the flush after them
//     (pull) it posted has completed; the outcome is nil when every
//     block arrived and passed its check, kvlease.ErrCanceled when a
//     cancel stopped it, and wraps ErrCorrupt for a block of the wrong
//     length or sum;
//   - source: the destination's done (sent after its own evidence),
//     once every send completed (push) or after the revocation (pull);
//     otherwise the revocation itself — the handoff's worker destroyed
//     and, pulled, its registrations unmapped — with an outcome that
//     wraps ErrRevoked;
//   - a request that completed with an error, a failed endpoint or a
//     cancel is not evidence: the side then revokes its own worker (and
//     registrations), and that revocation is its evidence.
//
// A destination whose source stopped in the middle of a message has no
// evidence: its blocks stay quarantined until the source resumes, its
// connection fails, or Close revokes everything still reading
// (ErrClosed).
//
// Config.StallTimeout (10 s) is each transfer's progress timeout,
// whatever the handoff's Deadline: a transfer that neither posts nor
// completes a send, receive or get for that long ends as on a cancel
// (the source revokes; the destination withdraws its receives), with an
// outcome that wraps ErrStalled. A frozen peer so holds our blocks for a
// bounded time, but for a receive or get already under way from a
// stopped source, which stays quarantined as above. Malformed or mismatched plane bytes are refused with
// ErrCorrupt, bad regions with kvlease.ErrInvalidArgument, before
// anything is attached.
//
// # Caveats
//
//   - UCX authenticates nobody: a process that reaches a worker's
//     transport can connect to it outside the control session, and UCX's
//     tcp transport honours a raw put from such a peer. Run UCX only
//     where every peer that can reach the workers is trusted, or use the
//     root module's TCP plane, which authenticates its data connections.
//   - Pull serves, in UCX 1.13's software emulation, any address of the
//     source process the destination names: use it only for a
//     destination as trusted as the source process itself.
//   - Device memory cannot be summed by the CPU: it moves only in
//     insecure sessions, needs a UCX built with CUDA support, and is
//     untested here (the tests cover host memory).
//   - A worker whose handshake a dead peer never finished cannot be
//     destroyed by UCX 1.13: it is abandoned (never progressed, never
//     freed; Abandoned counts them), holding a few sockets until the
//     process exits.
//   - Pushed, each side keeps up to Config.MaxIdle idle connections per
//     control session for the handoffs that follow; a connection is kept
//     only after a handoff that ended cleanly on its side.
package ucx
