// Package tiers is a tiered KV cache over kvlease pools: a device pool
// (G1), a pinned host pool (G2) and an optional disk tier (G3), as vLLM's
// offloading connector, SGLang's HiCache and Dynamo's KVBM keep more KV
// than fits in device memory.
//
// # Seal records
//
// A block's copy in a lower tier is sealed as the original was: the same
// hash, the same parent, the same place in its chain and, when it was
// sealed with them, the same tokens, so every tier's KV events describe
// it alike. The cache keeps no table of its own for that: the device and
// host pools record how each block was sealed (create them with
// kvlease.WithSealRecords, or with WithKVEvents or WithVerifiedPrefix,
// which keep the record too; New refuses a pool without), the cache reads
// the original's record (kvlease.Pool.SealInfo) and seals the copy with
// it (kvlease.Lease.SealAs). Cache.Seal, which knows the parent but not
// the tokens, records the parent all the same. A pool records tokens
// only with kvlease.WithBlockTokens: give every tier's pool the same
// block tokens, or the copies below one without keep the parent alone.
// The disk tier keeps the
// record in each slot's header instead (Disk is no kvlease pool the cache
// could ask after a restart; its index of the headers is the cache's
// disk table), and a block rebuilt from a slot is sealed as its header
// says.
//
// # Tenants
//
// The record includes the block's tags: the public namespace identifier
// of the tenant that sealed it (kvlease.Tenant.Namespace), its adapter
// and its extra keys (kvlease.SealInfo). Every copy keeps them (the disk
// in each slot, after the block: format version 4, and OpenDisk refuses
// files of an older one with ErrSlotFormat), every tier's KV events
// publish them, and a block below the device is onboarded only into the
// namespace it was stored under: Cache.AcquireFor a tenant (or Admit
// with a registered SequenceSpec.Tenant) finds only that tenant's blocks
// in the host and disk tiers, Acquire only blocks of no tenant, whatever
// their hashes, across a restart too.
//
// # Offload
//
// Every copy between tiers is a kvlease.Transfer that gates both sides: a
// Read on the source block (it stays out of reuse until the copy
// resolves) and a Write on the destination (it cannot be sealed or hit
// while in flux). A destination block is sealed in its tier, and so
// becomes findable there, only once its copy has resolved without error:
// a failed or quarantined copy leaves the lower tier without the block.
//
// With WriteBack (the default), the device pool's eviction hook
// (kvlease.Pool.SetEvictHook) offers each eviction victim it can spare;
// the hook only queues the offer, and the cache's offload worker copies it
// into a fresh host block and lets it drain. The evicting acquire is never
// blocked by the copy, nor by the host's allocator: it takes another
// victim. Free-block reserves (Config.DeviceReserve, HostReserve) offer
// least recently used blocks ahead of demand, so that acquires find free
// blocks instead of evicting what they would lose.
// With WriteThrough, Cache.Seal copies each block to the host as it is
// sealed. The host pool's victims go to the disk tier the same way
// (write-back) when there is one.
//
// # Onboard
//
// Cache.Acquire finds the longest prefix across the tiers, device hits
// first, then host hits, then disk hits, in chain order, pins the lower
// tiers' blocks, and returns an Onboard: a device lease whose onboarded
// blocks are gated by Write transfers until their copies resolve. The
// caller can wait (Onboard.Ready, Onboard.Wait with a context) or compute
// the fresh rest of the lease meanwhile. Disk hits travel through a host
// staging block, which joins the host tier. kvlease.Pool.AcquireHits is
// the primitive underneath: exactly the cached prefix, no fresh blocks.
// Pass Acquire only the hashes of blocks the request will not write
// (vLLM's last-token rule: never the block holding the prompt's last
// token). Cache.Admit is the same lookup for a request as a
// kvlease.Sequence, the rule applied: its Onboard carries the Sequence,
// and Wait records the onboarded blocks in it as hits.
//
// # Disk
//
// A Disk keeps fixed-size slots in preallocated files, read and written by
// a bounded pool of workers (pread/pwrite, O_DIRECT where the file system
// allows). Each slot records its block hash, its parent hash, the tier's
// namespace (the model's identity, DiskConfig.Namespace), the envelope or
// layout fingerprint and a checksum, so a torn or corrupted slot, or one
// written for another model or layout, is a miss, never wrong KV. With
// DiskConfig.Key the checksum is an HMAC-SHA256, and a slot forged by
// whoever can write the files but lacks the key is a miss too. OpenDisk
// rebuilds the index by scanning the files: the tier survives a restart
// (slots whose header, identity or checksum is bad are left out). The
// files hold KV and prompt tokens, so they are private: 0600 in a 0700
// directory of the process's user (a directory of another user, or one
// that group or others can write, is refused), opened without following
// symbolic links and, on Linux, relative to the directory that was
// checked (openat). The disk's queue of jobs is unbounded, so queueing
// never blocks a caller behind a slow disk.
//
// # Metrics and events
//
// Cache.Stats counts, per tier, hits, blocks offloaded into it, blocks
// onboarded from it, copy failures and offers dropped. For KV events,
// create the pools with kvlease.WithKVEvents (and WithBlockTokens; the
// disk's through DiskConfig.PoolOptions), seal with Cache.SealTokens, and
// publish Cache.EventSources: one source per tier with its medium
// (Tier.Medium: "GPU", "CPU", "DISK"). The device pool reports a block
// removed when it is evicted, the host pool reports it stored when its
// copy is sealed there, the disk likewise; a lower tier's stored event
// carries the original's parent and tokens (its pool's seal record,
// kvlease.Lease.SealAs).
package tiers
