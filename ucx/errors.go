package ucx

// #include <ucs/type/status.h>
import "C"

import (
	"errors"
	"fmt"

	"github.com/kvlease/kvlease"
)

var (
	// ErrCorrupt wraps plane bytes (Accept or Start) that are malformed or
	// do not match the regions they describe.
	ErrCorrupt = errors.New("ucx: malformed plane bytes")
	// ErrRevoked wraps the outcome of a transfer whose evidence is a
	// revocation: the handoff's registration was unmapped and its worker
	// destroyed, so nothing of UCX in this process touches the regions
	// any more.
	ErrRevoked = errors.New("ucx: registration revoked")
	// ErrClosed is the cause recorded for transfers revoked by Close.
	ErrClosed = errors.New("ucx: plane closed")
	// ErrStalled wraps the outcome of a transfer that made no progress
	// (no send, receive or get completed) for Config.StallTimeout: the
	// peer stopped sending or receiving. The transfer ended as on a
	// cancel (the source's outcome wraps ErrRevoked too) and fails; it
	// does not wrap kvlease.ErrCanceled.
	ErrStalled = errors.New("ucx: transfer stalled")
)

// errPullSecure refuses the pull model in an authenticated session: its
// blocks carry no sums bound to the session, and its source's worker
// serves the destination any address (see Trust in DESIGN.md).
var errPullSecure = fmt.Errorf("ucx: the pull model (Config.Pull) binds nothing to an authenticated session: push (the default), or run the halves Insecure on a trusted network: %w", kvlease.ErrInvalidArgument)

// errDeviceKeyed is the refusal of device memory in an authenticated
// session: its blocks must carry keyed sums, which the CPU can neither
// compute nor check over memory it cannot read.
var errDeviceKeyed = fmt.Errorf("an authenticated session's blocks must carry keyed sums, and blocks in device memory cannot (the CPU cannot read them): move host memory, or run an insecure session on a trusted network: %w", kvlease.ErrInvalidArgument)

// errWorkerGone is a call or a job for a worker already destroyed.
var errWorkerGone = errors.New("ucx: worker destroyed")

// ucsError is a UCX status code (ucs_status_t) as an error.
type ucsError int

// Error returns UCX's text for the status.
func (s ucsError) Error() string {
	return fmt.Sprintf("ucx: %s (%d)", C.GoString(C.ucs_status_string(C.ucs_status_t(s))), int(s))
}

// Is lets errors.Is match the root's cancellation sentinel: a cancelled
// request matches kvlease.ErrCanceled.
func (s ucsError) Is(target error) bool {
	return target == kvlease.ErrCanceled && C.ucs_status_t(s) == C.UCS_ERR_CANCELED
}

// status is st as an error: nil for UCS_OK.
func status(st C.ucs_status_t) error {
	if st == C.UCS_OK {
		return nil
	}
	return ucsError(st)
}
