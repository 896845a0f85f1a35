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
// protocol over one authenticated connection (internal/wire: the frame
// and who sends what; Propose, Accept, Reject, Start, Done, Abort and
// their Acks, each naming its handoff, each with a parse function; the
// psk record layer; the connection). A malformed frame ends the
// connection; a well-formed message that is duplicated, reordered or for
// an unknown handoff is refused and changes nothing; both wrap
// ErrProtocol. The blocks move
// over a data plane (SendPlane, RecvPlane): package tcp in pure Go, UCX
// in the nested module ucx/.
//
// # One state machine
//
// Handoff and each half's handle (Outgoing, Incoming) share one state
// machine (machine.go): one transition table, one function that performs
// transitions, the same History. State changes only in the handlers of
// inputs: a caller's method, a peer's message, the transfer's evidence
// (its kvlease.Transfer.OnResolve callback, which runs inside the
// transport's Resolve, so State is current once Resolve returns) and the
// timers of the deadlines. State, Err and History only read. The source
// half needs two facts before it is final, its own transfer's
// resolution and the destination's word; each is a note in the table
// (EventQuiescent, EventPeerOutcome), recorded in History.
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
// blocks until late evidence comes; time alone never frees them. An
// abort and the deadline cancel the transfer itself, not only the lease
// (a lease released once the handoff was under way, as rule 2 allows,
// is closed, and aborting it cancels nothing), so the plane's loop
// returns and its evidence lifts the quarantine.
//
// # Authentication
//
// Nothing that crosses the process boundary is trusted until it is
// authenticated. Both halves authenticate each other before any message
// is acted on, with HalfConfig.Auth: &PSK{ID, Key} (a pre-shared key, a
// challenge-response over both sides' nonces and ephemeral X25519
// shares; the session's keys come from the key and the X25519 secret,
// so a key that leaks later does not open recorded sessions; every
// control frame then travels sealed with AES-GCM under a per-direction
// sequence number, so a replayed, reordered or foreign frame ends the
// session) or &TLS{Config} (mutual TLS 1.3). Running
// without it takes Insecure: true, and each such session says so in the
// log; a secure half refuses an insecure peer (a downgrade). A refusal
// wraps ErrAuth and is counted (Source.Stats, Destination.Stats).
//
// The session binds the data plane: every PlaneID names the session's
// Peer, from which a plane derives its keys (Peer.Key); package tcp MACs
// each data connection's hello and tags each block (AES-GMAC, the handoff
// and the block index bound in), and sends blocks only to the
// authenticated peer's host. The destination's Authorize sees the
// proposer's identity (Peer.Identity: "psk:<id>", a certificate's URI SAN
// or subject).
//
// Every resource a peer can hold is bounded. Before it is authenticated:
// the handshake (HandshakeTimeout) and Listen's pending handshakes, per
// host (16) and in all (64,
// where the busiest host's oldest gives way, so one host that floods
// cannot keep another out). Per session: handoffs in flight
// (MaxHandoffs), blocks held (MaxSessionBlocks), the wait for Start
// (StartTimeout), the time with nothing in flight (SessionIdleTimeout).
// Per identity, across all its sessions (Limits, IdentityLimits): blocks
// held, handoffs in flight, sessions; and sessions in all
// (MaxSessions). A session refused by a cap is refused at the end of its
// handshake (ErrLimit); every refusal is counted (HalfStats). Final
// handoffs leave the tables, and a bounded set of recent ids (4096 a session)
// keeps refusing their reuse. The trust boundary: an authenticated peer
// can still send wrong but well-formed KV; kvlease guarantees who sent it
// and that nobody else could, not that the peer's model computed it
// right.
//
// # Explored
//
// Every interleaving of the two halves over small configurations, with
// lost, duplicated and reordered messages, stalled and frozen planes,
// deadlines and the engines' calls as choices, is explored by the tests
// (explore_test.go), with the properties and bounds stated in EXPLORER.md.
//
// # Capacity
//
// Envelope states the operating limits every component must agree on
// (AgreeEnvelopes), and CheckRequest answers before any block is touched.
package handoff
