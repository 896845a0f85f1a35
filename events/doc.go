// Package events publishes the KV events of kvlease pools to cache-aware
// fleet routers over ZeroMQ, in vLLM's wire format, so that llm-d's
// KV-cache indexer and NVIDIA Dynamo's KV router can route requests to the
// engine that holds the longest prefix.
//
// A Publisher drains the pools' event rings (kvlease.WithKVEvents) on its
// own goroutine and sends batches on a PUB socket:
//
//	frames   [topic, seq, payload]          topic kv@<pod>@<model>; seq 8 bytes big-endian, from 0
//	payload  [ts, events, data_parallel_rank]
//	events   BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name}
//	         BlockRemoved{block_hashes, medium}
//	         AllBlocksCleared{}
//
// encoded as msgpack maps with a "type" key (MapEncoding, current vLLM)
// or as tagged arrays (ArrayEncoding, older vLLM and llm-d ≤ v0.8). A
// ROUTER socket can replay the last batches; a loss is repaired with
// AllBlocksCleared and a re-announcement from SnapshotKVBlocks. The
// allocator never waits for the publisher: a slow subscriber costs
// dropped batches, counted in Stats.
//
// Routers key blocks by their tokens, so seal with Lease.SealTokens:
// stored events of blocks sealed with Seal (a hash only) are not sent and
// are counted as unpublishable. DecodeBatch decodes a payload as a
// subscriber would.
//
// The nested module interop/llmd runs llm-d's own subscriber and index
// against a Publisher. DYNAMO.md, in this directory, lists what Dynamo's
// reader additionally requires and how a Publisher meets it.
package events
