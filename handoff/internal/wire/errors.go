// Package wire is the control protocol between package handoff's two
// halves: the frame (frame.go: its layout and who sends what), the
// messages and their parsers (messages.go), the psk session's record
// layer (channel.go) and the framed control connection (conn.go). Only
// package handoff and its tests use it; handoff re-exports what callers
// need (ErrAuth, ErrProtocol, ProposeMsg, MaxPlane, MaxBlocks).
package wire

import (
	"errors"
	"fmt"
)

// The errors of the control protocol. Package handoff exports ErrAuth and
// ErrProtocol under the same names (the same values); the two kinds of
// protocol error are the halves' business.

// ErrAuth is wrapped by a record that does not verify (and by package
// handoff's every refusal of the authentication).
var ErrAuth = errors.New("kvlease: handoff authentication failed")

// ErrProtocol is wrapped by every error about a malformed or unexpected
// message. Each such error also wraps one of its two kinds, which say what
// the violation cost:
//
//   - ErrProtocolFatal: the bytes cannot be trusted (bad framing,
//     checksum, version or length, a payload that does not parse, a
//     record that does not verify): the connection ends.
//   - ErrProtocolRefused: a well-formed message the receiver will not act
//     on (an unknown handoff id, a message its handoff's state does not
//     allow, a reordering): it is refused, reported (HalfConfig.OnError)
//     and changes nothing; the connection goes on.
var ErrProtocol = errors.New("kvlease: handoff protocol violation")

// The two kinds of protocol error; both wrap ErrProtocol.
var (
	ErrProtocolFatal   = fmt.Errorf("fatal to the connection: %w", ErrProtocol)
	ErrProtocolRefused = fmt.Errorf("refused, nothing changed: %w", ErrProtocol)
)
