package kvlease

// CopyPair is one block copy: the contents of region Src are copied to region
// Dst. A transport copies whole regions; both sides have the block size of
// their pools.
type CopyPair[S, D any] struct {
	Src S
	Dst D
}

// A Transport moves block contents asynchronously: between workers
// (prefill → decode), between tiers (device ↔ pinned host) or inside one
// device. The GPU copy engine (package gpu) and the in-process transport
// used by tests and examples implement it; a network transport would too.
//
// The ordering contract is what makes aborts safe: Start creates the
// transfer (carrying the transport's cancel hook) and calls attach with it
// before a single byte moves. attach is where the caller registers the
// transfer with every lease whose blocks the copy touches (for a handoff:
// AttachRange on the source lease as Read, on the destination lease as
// Write). Only if attach returns nil does the copy start; if attach fails
// (a lease was closed meanwhile), nothing is enqueued, the transfer is
// resolved with attach's error (nothing touched the memory: that is
// evidence) and Start returns that error.
//
// Once started, the transport resolves the transfer only when it can prove
// the memory is quiescent (copy finished, DMA fenced), and quarantines it
// when it cannot (peer vanished, sticky device error). Cancel is a request:
// the hook may stop the copy early, but the transfer still resolves only on
// proof.
type Transport[S, D any] interface {
	Start(pairs []CopyPair[S, D], attach func(*Transfer) error) (*Transfer, error)
}
