package tcp

import (
	"errors"
	"fmt"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// The errors of the plane. Every one that ends a transfer is the outcome
// its kvlease.Transfer resolves with; a cancel wraps kvlease.ErrCanceled.

var (
	// ErrCorrupt wraps a frame whose index, length or checksum is not what
	// the receiver expects, and a malformed hello.
	ErrCorrupt = errors.New("tcp: corrupt data frame")
	// ErrClosed is the outcome of transfers stopped by Close.
	ErrClosed = errors.New("tcp: plane closed")
	// ErrNoData is the outcome of a receive whose data connection did not
	// arrive within Config.HelloTimeout: nothing was written.
	ErrNoData = errors.New("tcp: data connection never came")
	// ErrUnauthenticated wraps the refusal of a data connection that
	// does not prove it belongs to the handoff's authenticated session (a
	// hello whose MAC does not verify: a stolen, guessed or replayed
	// token; an unkeyed hello for a secure session). It wraps
	// handoff.ErrAuth.
	ErrUnauthenticated = fmt.Errorf("tcp: data connection not of the session: %w", handoff.ErrAuth)
	// ErrAddress wraps a sender's refusal of an Accept whose data address
	// is neither on the authenticated peer's host nor in
	// Config.AllowDataHosts: the blocks go only to the peer the session
	// authenticated. It wraps handoff.ErrAuth.
	ErrAddress = fmt.Errorf("tcp: data address not the authenticated peer's: %w", handoff.ErrAuth)
)

// ErrStalled is the outcome of a transfer whose data connection made no
// progress (not one byte read or written) for Config.StallTimeout: the
// peer stopped reading or writing. The loop returned, so it is evidence
// like any other failure; the transfer fails.
var ErrStalled = errors.New("tcp: data connection stalled")

// errStreamStopped is what a stop frame reads as.
var errStreamStopped = fmt.Errorf("tcp: the sender stopped the stream: %w", kvlease.ErrCanceled)

// helloError marks a writer's failure to write a handoff's hello and
// frame layout, before any block byte: nothing of the regions was read,
// and the receiver has not taken the token (Sender.start dials once more
// for it on a reused connection). The writers passed to start wrap the
// hello's write error with it.
type helloError struct{ err error }

func (e helloError) Error() string { return "tcp: hello: " + e.err.Error() }
func (e helloError) Unwrap() error { return e.err }

// isHelloError reports whether err is a writer's failure to write its
// hello (helloError).
func isHelloError(err error) bool {
	var h helloError
	return errors.As(err, &h)
}
