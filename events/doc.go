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
// # Tenants
//
// A block sealed by a registered tenant's lease carries the tenant's
// public namespace identifier (kvlease.Tenant.Namespace: "ns:" and 32
// hex digits of an HMAC under the tenant's secret, or its name with
// kvlease.WithPublicTenantNames). The publisher sends it as the last
// extra key of each chain's first block (the block with no parent), in
// extra_keys, where vLLM sends a request's cache_salt and SGLang its
// extra key: llm-d's indexer mixes a block's extra keys into its key, so
// two tenants' identical prompts are indexed apart, the whole chain
// after the first block included. A router looks a prompt up with the
// same extra key on its first block. The pool's secret, the tenant's
// secret and seeds, and (unless opted in) the tenant's name are never
// sent; a block of no tenant is sent exactly as before.
//
// # What the stream reveals, and to whom
//
// Every stored event carries the token ids of its block, so a subscriber
// learns every prompt prefix the engine caches, whoever sent it. The
// sockets speak ZeroMQ's NULL mechanism (no authentication, no
// encryption: what vLLM's and llm-d's sockets speak), so who can
// subscribe is decided by who can reach the endpoint. With no endpoint a
// Publisher binds 127.0.0.1 only; binding every interface (tcp://*:PORT,
// 0.0.0.0, ::) is an explicit choice that is logged at warning level, as
// is a bind on any other address that is not loopback. To serve routers
// on other hosts, bind a private interface, let the routers' hosts alone
// reach it (a firewall rule, a Kubernetes NetworkPolicy), or connect out
// to the router (an endpoint without "*" dials, so the engine opens no
// port at all); an ipc:// endpoint is guarded by its file's permissions.
//
// # A ZMTP implementation of our own
//
// The sockets are not go-zeromq/zmq4's: this package implements exactly
// what it serves of ZMTP 3.1 (rfc.zeromq.org specs 23 and 37, written
// from the specification): the greeting, the NULL mechanism, PUB with
// subscriptions in both ZMTP 3.0 (subscription messages) and 3.1
// (SUBSCRIBE/CANCEL commands) forms, PING/PONG, and a ROUTER that
// answers replay requests from DEALER or REQ clients. zmq4 runs each
// connection's handshake on its accept loop without a deadline (one idle
// connection stops every later subscriber) and allocates whatever size
// a peer's command header declares (73 bytes crash the process); a
// wrapper that made it safe would have to own every byte a peer sends
// before zmq4 read it, which is the handshake and the framing, most of
// a ZMTP implementation already, and still leave zmq4's queues and
// goroutines between the publisher and its subscribers. So the peer's
// side is ours, small and fuzzed (FuzzZMTPPeer), and the real
// implementations stay in the tests: zmq4 as subscriber and replay
// client here, llm-d's indexer in the nested module interop/llmd.
//
// What no peer can do (Config sets the limits): crash the process (every
// size is checked before anything is read or allocated: 1 MiB per
// message by default); stall the accept loop (handshakes run on their
// own goroutines, at most MaxHandshakes at a time, each cut off after
// HandshakeTimeout); hold up the allocator or other subscribers (each
// subscriber has its own queue of at most HWM messages and its own
// writer; a full queue drops that subscriber's messages, and a
// connection that accepts no byte for SendTimeout is closed); grow our
// state (only subscriptions that match the topic are kept, as counts);
// make one replay request cost more than ReplayPerRequest batches (each
// replay client is served on its own goroutine, one request at a time,
// at the pace it reads); or hold a place while doing nothing: a
// subscriber with no subscription is dropped after HandshakeTimeout (it
// is sent nothing, so SendTimeout never ends it), a replay client after
// ReplayIdleTimeout without a request. Nor can one address lock out the
// others: handshakes, subscribers and replay clients are capped per
// remote address (MaxPerAddress) as well as in total, and when a total
// cap is reached a connection from an address that holds fewer takes
// the place of the busiest address's oldest. A router on another
// address always gets through while one address floods.
//
// # Interoperability
//
// The nested module interop/llmd runs llm-d's own subscriber and index
// against a Publisher. DYNAMO.md, in this directory, lists what Dynamo's
// reader additionally requires and how a Publisher meets it.
package events
