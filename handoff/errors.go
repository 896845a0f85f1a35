package handoff

import (
	"errors"
	"fmt"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/wire"
)

// The errors of package handoff. Each is a sentinel to test with
// errors.Is; returned errors wrap them with context. A cancelled handoff's
// transfer ends with kvlease.ErrCanceled (the planes wrap it).

// ErrAuth is wrapped by every refusal of the authentication: a wrong key,
// an unknown or expired certificate, a downgrade, a handshake that timed
// out or did not parse, and, after the handshake, a control record that
// is replayed, reordered, spliced from another session or forged. The
// session ends; nothing of it was acted on.
var ErrAuth = wire.ErrAuth

// ErrProtocol is wrapped by every error about a malformed or unexpected
// message. Each such error also says which of two kinds it is, and so what
// the violation cost:
//
//   - fatal to the connection: the bytes cannot be trusted (bad framing,
//     checksum, version or length, a payload that does not parse, a
//     record that does not verify): the connection ends.
//   - refused: a well-formed message the receiver will not act
//     on (an unknown handoff id, a message its handoff's state does not
//     allow, a reordering): it is refused, reported (HalfConfig.OnError)
//     and changes nothing; the connection goes on.
var ErrProtocol = wire.ErrProtocol

// ErrState is returned when a handoff method is called in a state
// that does not allow it: Start after a rejection, Accept twice, Reject
// after the transfer started, Abort after delivery. The error names the
// state; nothing changed.
var ErrState = errors.New("kvlease: handoff in the wrong state")

// ErrRejected is the default reason recorded by Reject(by, nil).
var ErrRejected = errors.New("kvlease: handoff rejected")

// Errors of the halves.
var (
	// ErrConnLost is the reason recorded when a half's control connection
	// ends while a handoff is not final.
	ErrConnLost = errors.New("kvlease: handoff control connection lost")
	// ErrPeer wraps an outcome the peer reported (its Done error, its
	// abort cause): the peer's words, not evidence about our memory.
	ErrPeer = errors.New("kvlease: handoff peer reported")
	// ErrUnconfirmed is recorded when the source's own transfer resolved
	// but the destination never reported its outcome before the deadline.
	ErrUnconfirmed = errors.New("kvlease: handoff destination never confirmed delivery")
	// ErrLimit is the reason a destination refuses a proposal that would
	// pass a per-session cap (DestinationConfig.MaxHandoffs,
	// MaxSessionBlocks) or a per-identity one (Limits.Blocks, Handoffs),
	// a session past MaxSessions or its identity's Limits.Sessions (the
	// source's NewSource fails with it), and an Accepted handoff aborted
	// because its Start did not come within StartTimeout. It wraps
	// kvlease.ErrExhausted: the peer may retry once its own handoffs (or
	// sessions) have ended.
	ErrLimit = fmt.Errorf("kvlease: handoff limit: %w", kvlease.ErrExhausted)
)

// errIdle ends a session that had nothing in flight for its idle timeout.
var errIdle = errors.New("kvlease: handoff destination: session idle")

// rejectSentinel is the sentinel a Reject message's code stands for:
// what the source's error wraps.
func rejectSentinel(c wire.RejectCode) error {
	switch c {
	case wire.RejectExhausted:
		return kvlease.ErrExhausted
	case wire.RejectCapacity:
		return kvlease.ErrExceedsCapacity
	case wire.RejectEnvelope:
		return kvlease.ErrInvalidArgument
	case wire.RejectDuplicate:
		return ErrState
	case wire.RejectClosed:
		return kvlease.ErrPoolClosed
	case wire.RejectLimit:
		return ErrLimit
	case wire.RejectNamespace:
		return ErrNamespace
	}
	return ErrRejected
}

// rejectCode maps a destination's error to its code.
func rejectCode(err error) wire.RejectCode {
	switch {
	case errors.Is(err, ErrNamespace):
		return wire.RejectNamespace
	case errors.Is(err, ErrLimit):
		return wire.RejectLimit
	case errors.Is(err, kvlease.ErrExceedsCapacity):
		return wire.RejectCapacity
	case errors.Is(err, kvlease.ErrExhausted):
		return wire.RejectExhausted
	case errors.Is(err, kvlease.ErrPoolClosed):
		return wire.RejectClosed
	case errors.Is(err, ErrState):
		return wire.RejectDuplicate
	case errors.Is(err, kvlease.ErrInvalidArgument):
		return wire.RejectEnvelope
	}
	return wire.RejectPolicy
}
