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
// # Overview
//
// What the package exports, by concept (one file each):
//
//   - Memory: BlockID, BlockRef, Memory, HostMemory (NewHostMemory, Span).
//   - Runs: Run, AppendRuns (and Lease.AppendRuns): contiguous runs of
//     block ids, one copy each.
//   - Pool (NewPool, options With...: WithObserver, WithLeakCheck,
//     WithDrainDeadline, WithQuarantineAlert, WithKVEvents, WithBlockTokens,
//     WithVerifiedPrefix, WithSealRecords): Acquire, AcquireWait, AcquirePrefix,
//     AcquirePrefixTokens, AcquireHits, CachedPrefix, CachedPrefixTokens,
//     Region, Stats, Available, Usable, Capacity, BlockBytes, Memory, Check
//     (consistency), CheckQuiescent (at rest: QuiescenceError, Holding),
//     Close, ResetCache (ResetMode), SetEvictHook and OfferCached
//     (EvictOwner), DrainKVEvents, KVEventsReady, SnapshotKVCache,
//     SnapshotKVBlocks (KVEvent, KVEventKind), SealInfo and
//     KeepsSealRecords (how a block was sealed: SealInfo).
//   - Lease: Len, Owner, ID, Pool, Ref, AppendBlockIDs, AppendRuns, Region, ReadRegion,
//     AppendRegions, AppendReadRegions, Extend, TrimTo, Trimmed, Attach,
//     AttachRange (Access: Read, Write), Seal, SealTokens, SealChained,
//     SealAs, Share, Release, Abort, Settled, State (LeaseState), Closed.
//   - Transfer (NewTransfer): Resolve, Quarantine, Cancel, Done, Err, State
//     (TransferState), ID, CancelRequested; TransferGroup
//     (NewTransferGroup, AttachGroup, AttachGroupRange) for per-rank
//     transfers of one logical copy; Transport and CopyPair, what a data
//     plane implements.
//   - Prefix hashes: BlockHash, HashBlock, ChainHashes; HashBlockExtra
//     and ExtraKey (extra keys), Hasher (WithHasher, Pool.HashBlocks: a
//     batch of blocks per call, an error path, the caller's seed as root);
//     Token, TokensInt32, TokensUint32, HashTokens, ChainTokens (uint32
//     token ids without a copy).
//   - Sequence (Pool.NewSequence, Pool.Admit with a SequenceSpec, every
//     size in it checked first; Pool.AdmitWith for a caller's lookup such
//     as tiers.Cache.Admit): a request's tokens over a lease: Append,
//     Commit (never implied, never silently missing), AppendComputed,
//     Rollback, Reserve, Onboarded, growth and a seal per full block;
//     sliding windows (SequenceSpec.Window, Base) trim as they commit.
//   - Engine policy: Adapter (Lease.SetAdapter: lora tags in KV events
//     and the adapter's retention, by name), Retention (Lease.SetRetention,
//     Pool.SetAdapterRetention, Pool.CachedByRetention: eviction classes),
//     tenants (WithTenantKey, Pool.TenantSeed: namespaces; Pool.Tenant,
//     Tenant.SetQuota with a Quota, Pool.TenantStats: a cap and a
//     reservation per tenant), Stats.InUse.
//   - Observation: Observer, ObserverFunc, Event, EventKind.
//   - Errors: ErrInvalidArgument, ErrExceedsCapacity, ErrExhausted,
//     ErrQuarantineBound, ErrQuota, ErrPoolClosed, ErrLeaseClosed,
//     ErrStaleRef, ErrReadOnly, ErrAborted, ErrQuarantined,
//     ErrDrainDeadline, ErrNotQuiescent.
//
// What users must not touch lives under internal/: the slot table
// (internal/slots), the checked-build switches (internal/invariants).
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
// # Concurrency
//
// Every method of Pool, Lease and Transfer is safe for concurrent use: an
// Abort from a request's HTTP goroutine may race the scheduler's Extend
// (the loser gets ErrLeaseClosed). Cancel hooks and observers run with no
// internal lock held, so they may call back into the library; a cancel
// hook may Resolve its transfer synchronously.
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
// unreferenced cached blocks; ResetCache(ResetAll) also makes blocks in
// use unfindable (after a weight update).
//
// KV events (WithKVEvents) tell a cache-aware router which blocks became
// findable or stopped being so, with sequence numbers and a bounded ring
// that never blocks the allocator.
//
// # Quarantine and capacity
//
// Quarantined blocks are never reused until late evidence arrives, so
// they shrink what the pool can ever serve: Stats.Usable (Pool.Usable) is
// capacity minus quarantined blocks, and admission should be asked
// against it. A request for more than could ever be free while the
// quarantine lasts fails with ErrQuarantineBound, which wraps ErrExhausted
// (old callers still retry; new ones can tell retrying will not help); a
// queued AcquireWait waiter in that position is failed with it rather than
// blocking the queue. WithQuarantineAlert tells the observer when
// quarantined blocks exceed a share of the pool. Stats.QuarantinedLeased
// counts the quarantined blocks running requests still hold.
//
// # Disaggregated handoff
//
// Package handoff (github.com/kvlease/kvlease/handoff) moves a request's
// KV from a prefill worker's lease to a decode worker's pool in two phases
// (propose, accept or reject, start), in one process over a Transport or
// across processes over a connection. A rejected handoff can never start a
// transfer; an aborted one drains until the transport proves quiescence;
// one whose evidence never comes is quarantined. Its Envelope states the
// operating limits every component must agree on, and CheckRequest
// answers before any block is touched.
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
