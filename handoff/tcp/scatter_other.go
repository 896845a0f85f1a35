//go:build !linux

package tcp

import "net"

// newScatter returns a scatter reader over c: one Read per call.
func newScatter(c net.Conn, _ int) scatter { return plainScatter{c} }

// newGather returns a gathered writer over c: one Write per buffer.
func newGather(c net.Conn) gather { return plainGather{c} }
