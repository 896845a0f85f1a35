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
// # Capacity
//
// Envelope states the operating limits every component must agree on
// (AgreeEnvelopes), and Admit answers before any block is touched.
package handoff
