// Package handoff moves a request's KV cache from a prefill worker to a
// decode worker, in one process or across processes, under kvlease's
// rules: a rejection is final, a transfer that touches a block gates its
// reuse until the transport proves the memory quiescent, and a transfer
// that ends without proof quarantines its blocks.
//
// # In one process
//
// Handoff is the two-phase handoff between a source lease and a
// destination pool that live in the same process: Propose, then Accept or
// Reject, then Start over a kvlease.Transport (package inproc is an
// in-process transport that misbehaves on purpose). See Handoff for the
// state diagram and the evidence behind each state.
//
// # Across processes
//
// Source (the prefill side, holding only its own leases) and Destination
// (the decode side, holding only its own pool) are the two halves of a
// handoff in different processes. They speak a small versioned control
// protocol over one connection (proto.go: Propose, Accept, Reject,
// Start, Done, Abort and their Acks, each frame crc32c-checked and
// naming its handoff; anything malformed, duplicated, reordered or for
// an unknown handoff is refused and changes nothing), and move the
// blocks over a data plane (SendPlane, RecvPlane): package tcp in pure
// Go, UCX in the nested module ucx/. Each half keeps the same states,
// table and History as Handoff.
//
// The destination takes its own prefix-cache hits on accept and asks
// for the missing blocks alone; delivered blocks are sealed on arrival
// (with their tokens, Source.ProposeTokens, which verified mode needs).
// An abort on either side travels over the control connection and both
// sides drain until their own evidence. A side resolves only what it can
// prove about its own memory: the peer's word is not evidence, and
// losing the control connection rejects what had not started while a
// started transfer still ends by its plane's evidence (Failed when the
// data stopped short). No evidence by the deadline quarantines the
// blocks until late evidence comes; time alone never frees them.
//
// # Capacity
//
// Envelope states the operating limits every component must agree on
// (AgreeEnvelopes), and Admit answers before any block is touched.
package handoff
