package ucx

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
)

// errPullSecure refuses the pull model in an authenticated session: its
// blocks carry no sums bound to the session, and its source's worker
// serves the destination any address (see Trust in the package doc).
var errPullSecure = fmt.Errorf("ucx: the pull model (Config.Pull) binds nothing to an authenticated session: push (the default), or run the halves Insecure on a trusted network: %w", kvlease.ErrInvalidArgument)

// errDeviceKeyed is the refusal of device memory in an authenticated
// session: its blocks must carry keyed sums, which the CPU can neither
// compute nor check over memory it cannot read.
var errDeviceKeyed = fmt.Errorf("an authenticated session's blocks must carry keyed sums, and blocks in device memory cannot (the CPU cannot read them): move host memory, or run an insecure session on a trusted network: %w", kvlease.ErrInvalidArgument)
