// Package kvlease owns the paged KV-cache memory of an LLM serving engine.
// It answers one question with evidence instead of hope: who may touch
// this block right now, and what proves that nobody else will?
//
// Serving engines split each request's KV cache into fixed-size blocks,
// share them between requests (prefix caching) and move them
// asynchronously between workers and tiers. kvlease hands blocks out as
// typed leases (Lease[R], where R names a region: []byte for host memory,
// a device pointer for GPU memory) and returns a lease's blocks to the pool
// only after every transfer attached to it has resolved.
//
// This comment explains the concepts and what the caller must do; each
// type's own comment is its contract. The examples (go doc -all, and
// examples/quickstart in the repository) show the calls.
//
// # Rules
//
//  1. A rejection is final and settles everything. An Acquire that fails
//     allocates nothing: there is no half-owned state to clean up.
//  2. Release is a request, reclamation is an event. Release and Abort close
//     a lease at once, but each block returns to the pool only when every
//     transfer that touches it has resolved.
//  3. Only quiescence is evidence. A transfer resolves when the transport
//     proves it will never touch the memory again (copy finished, DMA
//     fenced, remote registration revoked). "Cancel requested" is not
//     evidence.
//  4. Unknown means quarantined, never reused. A transfer that ends without
//     proof quarantines its blocks; only a later Resolve lifts that. Time
//     alone never does.
//  5. Every reuse is a new generation. A BlockRef from an older generation
//     is detected (ErrStaleRef), never silently served. A prefix-cache hit
//     shares the same content, so it keeps the generation.
//  6. Capacity agrees everywhere: one Envelope (package handoff)
//     describes the operating limits, validated once, and admission uses
//     it before any handoff.
//  7. Every block is in exactly one state: free, cached, leased, draining or
//     quarantined. Stats shows the five counts; they always sum to the
//     capacity. Check proves the bookkeeping consistent, not that nothing
//     is held; CheckQuiescent proves the pool at rest (no lease open,
//     draining or quarantined, no waiter) and names who holds what.
//
// # Blocks and memory
//
// A pool manages the blocks of one Memory: a fixed number of equal
// regions (NewHostMemory for host memory; package gpu for device and
// pinned memory). A block is named by its BlockID and, across reuse, by
// a BlockRef: its id and the generation of its slot. The generation
// changes whenever the slot is handed out fresh, so a ref kept past its
// block's life (by a transport, a router, a log) is detected as stale
// rather than silently served someone else's data. The pool hands a
// lease's fresh blocks out as few contiguous runs of ids as it can
// (AppendRuns), since moving KV costs per descriptor more than per byte.
//
// # Leases
//
// A lease is one owner's hold on some blocks. Acquire is all or nothing;
// AcquireWait queues, first in first out, and a plain Acquire never
// overtakes a queued waiter. Extend grows an open lease (decode), TrimTo
// gives back its leading blocks (sliding windows), Share hands sealed
// blocks to a second lease (parallel sampling). Region returns a block
// for writing and refuses sealed or shared blocks (ErrReadOnly);
// ReadRegion returns any held block for reading.
//
// Release and Abort close a lease at once and are idempotent; Abort also
// asks every unresolved transfer to cancel. A closed lease drains: its
// blocks come back as the transfers gating them resolve, and Settled is
// closed when it holds nothing. State says where it is
// (LeaseQuarantined: a gating transfer ended without proof).
//
// # Transfers and evidence
//
// A Transfer is a transport's statement about memory in flight. The
// caller attaches it to the leases whose blocks it touches (Attach,
// AttachRange) with an Access: Read (a send, an offload) or Write (a
// receive, an onload). A pending transfer keeps its blocks out of reuse;
// a pending Write also keeps them from being sealed or hit. The transport
// ends it in one of two ways: Resolve, once it can prove the memory
// quiescent (the only evidence), or Quarantine, when it cannot. Cancel
// only asks the transport (through the hook given to NewTransfer) to stop
// early; the transfer still ends by Resolve or Quarantine. OnResolve runs
// a callback inside the winning Resolve, after the blocks are back, so a
// component that acts on evidence needs no goroutine per transfer.
//
// A Transport (a copy engine, a data plane) creates its transfer and
// attaches it before a single byte moves: if attaching fails because a
// lease closed meanwhile, nothing starts and the transfer resolves with
// that error. This ordering is what makes an abort safe.
//
// # Lifecycle
//
//	              Acquire fails ──▶ (nothing held, an error)
//	              Acquire
//	                 │
//	                 ▼
//	┌──────────── Active ──────── transfer quarantined ──────┐
//	│                │                                        ▼
//	│        Release / Abort                             Quarantined
//	│                │                                   │  ▲  │
//	│                ▼                                   │  │  │ late Resolve
//	│            Draining ─── transfer quarantined ──────┘  │  ▼
//	│                │                      (Release/Abort: stays, closed)
//	│     last gating transfer resolves          Active | Draining | Settled
//	│                ▼
//	└─(nothing gates)─▶ Settled
//
// A transfer is Pending until the transport resolves it (Resolved, the only
// evidence) or quarantines it (Quarantined: ended without proof; a late
// Resolve still lifts it). Cancel is a request to the transport, not a
// state.
//
// # Quarantine and capacity
//
// Quarantined blocks are never reused until late evidence arrives, so
// they shrink what the pool can ever serve: Stats.Usable is
// capacity minus quarantined blocks, and admission should be asked
// against it. A request for more than could ever be free while the
// quarantine lasts fails with ErrQuarantineBound, which wraps ErrExhausted
// (old callers still retry; new ones can tell retrying will not help); a
// queued AcquireWait waiter in that position is failed with it rather than
// blocking the queue. WithQuarantineAlert tells the observer when
// quarantined blocks exceed a share of the pool, and WithDrainDeadline
// quarantines and cancels the transfers of a lease that stays unsettled
// too long (still freeing nothing: time is not evidence; the transport's
// return after the cancel is).
//
// # Prefix cache
//
// A full block whose content will not change is sealed with the chained
// hash of its tokens (ChainHashes, HashBlock). Sealed blocks are shared by
// reference count; when nobody references them they stay cached, in an
// LRU, until a fresh block is needed and nothing is free. AcquirePrefix
// finds the longest cached prefix.
//
// A 64-bit hash hit is a probabilistic claim. With b distinct blocks
// cached, the chance that two share a hash is about b²/2⁶⁵: 2.7·10⁻⁸ at
// 10⁶ cached blocks, 2.7·10⁻² at 10⁹. xxhash is not cryptographic, so a
// tenant who chooses token ids can craft a collision and, in plain mode, be
// handed another tenant's KV. The verified mode (WithVerifiedPrefix,
// SealTokens, AcquirePrefixTokens) keeps each sealed block's parent and
// tokens and checks them on every hit: a mismatch is a miss. Use it
// wherever tenants do not trust each other.
//
// Sealed content is immutable and may be shared: Lease.Region, the
// writable accessor, refuses a block that is sealed or shared with another
// lease (ErrReadOnly), and Lease.ReadRegion serves any held block for
// reading. So a prefix lookup must never hit the block the request will
// write: token-based lookups (AcquirePrefixTokens, CachedPrefixTokens)
// never hit the block holding the prompt's last token (vLLM's rule), and
// callers of AcquirePrefix pass only the hashes before it. Stats counts
// prefix queries and hits for admitted lookups only. ResetCache drops
// unreferenced cached blocks; ResetCache(true) also makes blocks in
// use unfindable (after a weight update).
//
// Eviction takes the least recently used block of the lowest retention
// class that has one (Lease.SetRetention, Pool.SetAdapterRetention), a
// chain from its end. WithHasher replaces the block hash (to reproduce
// another system's keys); extra keys (HashBlock's extra keys: an image's content
// hash over its placeholder tokens) enter the hash of exactly the blocks
// they cover. KV events (WithKVEvents) tell a cache-aware router which
// blocks became findable or stopped being so, with sequence numbers and a
// bounded ring that never blocks the allocator.
//
// # Sequences
//
// A Sequence is one request's tokens over one lease: what an engine
// otherwise writes by hand around the pool. Pool.Admit
// hashes the prompt once, takes its prefix hits and checks every size of
// the SequenceSpec before anything is held. Append gives new tokens slots,
// growing the lease at block boundaries; Commit says their KV is written
// and seals every block that filled; Rollback takes back rejected
// speculative tokens. Commit is never implied: Append refuses while
// earlier tokens are neither committed nor rolled back, so a forgotten
// Commit is an error at the next step, not a cache that stays empty. A
// sliding-window sequence (SequenceSpec.Window) starts its lease at Base
// and trims what falls out of the window.
//
// # Tenants
//
// Tenants are separated in two ways. Namespaces: with WithTenantKey, the
// pool derives each tenant's chain root from a secret it holds
// (TenantSeed, an HMAC), so a request of one tenant can neither hit nor
// time another's blocks, whatever public salt it copies; blocks within a
// tenant are shared as before. Pass the seed wherever a seed goes
// (Pool.Admit, SequenceSpec.Seed, AcquirePrefixTokens). Quotas:
// Pool.Tenant registers a tenant whose acquires are charged for the fresh
// blocks they take until those are free; Tenant.SetQuota caps what it
// holds (at the cap it evicts its own cached blocks; beyond it ErrQuota,
// which wraps ErrExhausted) and reserves its newest cached blocks against
// other tenants' demand. Both cost O(1) per block.
//
// # Concurrency
//
// Every method of Pool, Lease, Transfer and Tenant is safe for concurrent
// use: an Abort from a request's HTTP goroutine may race the scheduler's
// Extend (the loser gets ErrLeaseClosed). Cancel hooks, OnResolve
// callbacks and observers run with no internal lock held, so they may call
// back into the library; a cancel hook may Resolve its transfer
// synchronously. Observers may be called concurrently and should be quick.
// A Sequence is not safe for concurrent use: one scheduler goroutine
// drives it, though its lease may be aborted from anywhere. A Hasher must
// be deterministic and safe for concurrent use.
//
// # What the caller must do
//
//   - End every lease with Release or Abort. A lease that becomes
//     unreachable while open is a leak: its blocks are never reclaimed
//     behind the owner's back, only reported (WithLeakCheck, on in checked
//     builds, reports EventLeaked to the observer).
//   - End every transfer with Resolve (on proof) or Quarantine (without).
//     A transfer that is never ended holds its blocks forever, by design.
//   - Not keep a region past the lease that returned it, and never write
//     through ReadRegion: the library cannot see either, and the block may
//     already be someone else's.
//   - Pass prefix lookups only the hashes of blocks the request will not
//     write (the token-based calls do this for you).
//   - Close a pool before the memory under it (a gpu arena refuses to
//     close while copies touch it), and call CheckQuiescent at shutdown or
//     at the end of a test to prove nothing is still held.
//
// Errors wrap the package's sentinels (ErrInvalidArgument,
// ErrExceedsCapacity, ErrExhausted, ErrLeaseClosed, ErrStaleRef, ...)
// with context: test them with errors.Is. Invalid arguments are returned
// as errors, never panics; the exceptions are indexes outside a block
// table or a memory (Lease.Ref, AppendBlockIDs, HostMemory.Region), which
// panic like a slice index.
//
// # Disaggregated handoff
//
// Package handoff (github.com/kvlease/kvlease/handoff) moves a request's
// KV from a prefill worker's lease to a decode worker's pool in two phases
// (propose, accept or reject, start), in one process over a Transport or
// across processes over an authenticated connection. A rejected handoff
// can never start a transfer; an aborted one drains until the transport
// proves quiescence; one whose evidence never comes is quarantined. Its
// Envelope states the operating limits every component must agree on,
// and CheckRequest answers before any block is touched. Packages tiers
// (host and disk offload), groups (sliding-window models), gpu, events
// and metrics build on the same rules.
//
// # Checked builds
//
// Under -race or -tags invariants, every locked operation verifies the
// state counts as it releases the pool's lock, impossible internal states
// panic, the slot table's fast loops sometimes take their general path
// instead (so tests and fuzzers prove the two equal), and every lease
// carries a leak check that reports to the observer (see WithLeakCheck).
// Pool.Check walks the whole slot table in any build.
package kvlease
