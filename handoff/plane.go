package handoff

import (
	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/wire"
)

// The data plane: how block contents cross between the processes of a
// handoff, apart from the control messages. A network transport (package
// tcp; UCX in the nested module ucx/) implements SendPlane on the source
// side and RecvPlane on the destination side. The halves call them in
// this order:
//
//	destination, on Propose:  RecvPlane.Prepare → bytes carried in Accept
//	source, on Accept:        SendPlane.Send(accept bytes, attach) → bytes carried in Start
//	destination, on Start:    RecvPlane.Receive(start bytes, attach)
//	source, on Done or Abort: SendPlane.Finish (the peer's word; a pull
//	                          model revokes the peer's access here)
//
// A push transport (TCP) dials from Send and streams; a pull transport
// (UCX) registers the source regions in Send, puts the remote keys in the
// Start bytes, and the destination reads them from Receive. The plane
// bytes are opaque to the halves (at most MaxPlane bytes each).
//
// Evidence. Each plane creates its side's kvlease.Transfer, calls attach
// with it before touching any region (if attach fails it must resolve the
// transfer with attach's error and touch nothing), and resolves it only
// with proof about its own side's memory: a goroutine of ours that reads
// or writes the regions has returned, a completion we own has fired, or
// the peer's access was revoked. The transfer's cancel hook is a request
// to stop; a plane that cannot prove quiescence leaves the transfer
// pending, and the half's deadline quarantines it.

// Limits of the control protocol a data plane must keep to.
const (
	// MaxPlane is the most data-plane bytes an Accept or a Start carries.
	MaxPlane = wire.MaxPlane
	// MaxBlocks is the most blocks one handoff moves.
	MaxBlocks = wire.MaxBlocks
)

// PlaneID identifies one handoff to a data plane on one side: the local
// number of its control connection (a session) and the handoff id the
// control messages carry. It is a local key: a plane that needs the peer
// to name the handoff (a data connection's token) puts its own random
// token in the plane bytes.
//
// Peer is the session's authenticated peer (nil only for an id made by
// hand, outside the halves): a plane that must bind its data to the
// session derives its keys from it (Peer.Key), and refuses to move
// blocks for a secure session without them.
type PlaneID struct {
	Session uint64
	Handoff uint64
	Peer    *Peer
}

// SendPlane is the source side's data plane.
type SendPlane[R any] interface {
	// Send starts moving regions (in order: the source's blocks
	// From..Blocks-1) to the destination that described itself with
	// accept (the Accept message's plane bytes). It creates the transfer,
	// calls attach before reading any region, and returns the Start
	// message's plane bytes. The transfer gates the source blocks as a
	// Read; it resolves once the plane will never read them again.
	Send(id PlaneID, regions []R, accept []byte, attach func(*kvlease.Transfer) error) (start []byte, err error)
	// Finish tells the plane that the destination reported its outcome
	// (Done: nil or its error) or gave up (Abort), or that the control
	// connection was lost (an error). A pull plane revokes the
	// destination's access here, which is its evidence; a push plane
	// already has its own and may ignore it.
	Finish(id PlaneID, peer error)
}

// StreamSendPlane is a SendPlane that can send while the source's blocks
// are still being written (a streaming handoff: Streaming). Its
// SendStream is Send with the prefill's progress: it may read part
// (region i, layer j) of regions only once ready says it is written
// (Ready.Wait), sends what is written as it is marked, and the rest
// later; the Start bytes are returned at once, before the blocks are
// written. Everything else is Send's contract: attach before reading,
// the transfer gates the regions as a Read and resolves only once the
// plane will never read them again (a cancel also ends a wait for
// progress). A SendPlane that is not a StreamSendPlane still carries a
// streaming handoff: the source calls its Send once the progress is
// complete.
type StreamSendPlane[R any] interface {
	SendPlane[R]
	SendStream(id PlaneID, regions []R, ready Ready, accept []byte, attach func(*kvlease.Transfer) error) (start []byte, err error)
}

// RecvPlane is the destination side's data plane.
type RecvPlane[R any] interface {
	// Prepare readies the plane to receive blocks blocks for id and
	// returns the Accept message's plane bytes (an address and a token, a
	// worker address). Nothing is attached yet.
	Prepare(id PlaneID, blocks int) (accept []byte, err error)
	// Receive moves the blocks into regions (the destination lease's
	// blocks From..Blocks-1, in order), given the Start message's plane
	// bytes. It creates the transfer, calls attach before writing any
	// region, and returns; the transfer gates the regions as a Write and
	// resolves once the plane will never write them again: nil when every
	// block arrived intact, an error otherwise.
	Receive(id PlaneID, regions []R, start []byte, attach func(*kvlease.Transfer) error) error
	// Forget drops a prepared id that will never be received (rejected,
	// aborted before Start, connection lost). It is a no-op for an id
	// already received or unknown.
	Forget(id PlaneID)
}

// PlaneStats counts what a data plane did: what package tcp's Sender
// and Receiver return from Stats, and what package metrics exports for a
// plane. Fields a plane has no use for stay zero.
type PlaneStats struct {
	Started, Completed, Failed, Canceled int
	// Stalled counts, of the Failed, the transfers whose data connection
	// made no progress for the plane's progress timeout (tcp.ErrStalled).
	Stalled int
	Bytes   int64
	// Refused counts data connections refused for any reason (garbage,
	// an unknown token, an unauthenticated hello, too many pending).
	Refused int
	// RefusedAuth counts those refused because their hello did not prove
	// the session (tcp.ErrUnauthenticated).
	RefusedAuth int
	// RefusedBusy counts those closed before their hello to keep to
	// MaxPendingHellosPerHost and MaxPendingHellos: refused at once, or
	// given way to a newer one from another host.
	RefusedBusy int
	// RefusedAddr counts, on a sender, Accepts refused for a data address
	// outside the authenticated peer's host (tcp.ErrAddress).
	RefusedAddr int
	// AcceptErrors counts failed accepts of the receiver's listener,
	// retried after a backoff.
	AcceptErrors int
	// Dials counts data connections dialled (a sender) or accepted (a
	// receiver).
	Dials int
	// Reuses counts handoffs carried by a connection that had carried
	// another before: taken from a sender's pool, or a hello accepted on
	// a receiver's idle connection.
	Reuses int
	// IdleExpired counts idle connections closed for their idle timeout
	// (a sender's, parked ones included; a receiver's twice as long).
	IdleExpired int
	// Stale counts, on a sender, idle connections found closed by the
	// receiver when taken, or whose hello could not be written: the
	// handoff dialled a fresh one instead.
	Stale int
	// Idle is the number of idle connections now (a gauge).
	Idle int
}
