// Package tcp is a pure-Go data plane for cross-process handoffs: the
// source pushes blocks over a TCP data connection to the destination's
// data listener, while the control messages travel on the handoff's
// control connection (package handoff's Source and Destination). Sender
// implements handoff.SendPlane[[]byte] and handoff.StreamSendPlane[[]byte],
// Receiver handoff.RecvPlane[[]byte]; SendLayered and ReceiveLayered give
// the same planes for layered regions (LayeredRegion).
//
// The contract:
//
//   - Evidence. Each side resolves its own kvlease.Transfer only when the
//     goroutine that reads or writes its regions (and its checker) has
//     returned: finished, failed, cancelled, stalled past
//     Config.StallTimeout (ErrStalled) or stopped by Close (ErrClosed). A
//     cancel ends a blocked read or write at once, with an outcome that
//     wraps kvlease.ErrCanceled.
//   - Binding. In an authenticated session every data connection's hello
//     carries an HMAC and every block an AES-GMAC tag derived from the
//     session, the handoff and a random token: a connection that does not
//     prove its session is refused (ErrUnauthenticated), a block of
//     another handoff fails its transfer (ErrCorrupt), and a sender sends
//     only to the authenticated peer's host (ErrAddress, unless
//     Config.AllowDataHosts names the host). Blocks are authenticated,
//     not encrypted; an insecure session gets a crc32c per frame.
//   - Bounds. Connections waiting for their first hello are capped per
//     host and in all (Config.MaxPendingHellosPerHost,
//     Config.MaxPendingHellos), each must say hello within
//     Config.HelloTimeout, idle connections are capped
//     (Config.MaxIdleConns) and expire (Config.IdleTimeout), and anything
//     malformed is refused before a byte reaches a region, changing
//     nothing (counted in Stats, told to Config.OnError).
//   - Reuse. A data connection carries one handoff at a time and is
//     reused only after a handoff that ended cleanly on both sides.
//
// DESIGN.md tells how the plane keeps this (the wire, reuse, streaming,
// the evidence case by case); wire.go holds every byte layout.
package tcp
