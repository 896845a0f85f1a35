package tcp

import (
	"net"
	"time"
)

// DefaultMaxPendingHellos is Config.MaxPendingHellos when zero.
const DefaultMaxPendingHellos = 64

// DefaultMaxPendingHellosPerHost is Config.MaxPendingHellosPerHost when
// zero.
const DefaultMaxPendingHellosPerHost = 16

// DefaultMaxIdleConns is a sender's Config.MaxIdleConns when zero: idle
// data connections kept per destination data address.
const DefaultMaxIdleConns = 4

// DefaultReceiverIdleConns is a receiver's Config.MaxIdleConns when
// zero: idle data connections kept in all, across senders.
const DefaultReceiverIdleConns = 64

// DefaultIdleTimeout is Config.IdleTimeout when zero.
const DefaultIdleTimeout = 30 * time.Second

// DefaultStallTimeout is Config.StallTimeout when zero or negative.
const DefaultStallTimeout = 10 * time.Second

// Config configures a Sender or a Receiver. The zero value is usable.
type Config struct {
	// DialTimeout bounds the sender's dial (5 s when zero).
	DialTimeout time.Duration
	// HelloTimeout bounds the receiver's wait for a data connection's
	// hello once it is accepted, and a Receive's wait for its data
	// connection (5 s when zero).
	HelloTimeout time.Duration
	// WrapConn, if set, wraps every data connection once, when it is
	// dialled or accepted (tests use it to observe or break the stream;
	// a reused connection carries several handoffs through one wrapper).
	WrapConn func(net.Conn) net.Conn
	// OnError, if set, is told why the receiver refused a data
	// connection (garbage, half a hello, an unknown token: an error
	// wrapping ErrCorrupt; a hello that does not prove its session:
	// ErrUnauthenticated; one past MaxPendingHellos), and why its accept
	// loop backed off. A refusal changes nothing else.
	OnError func(error)
	// AllowDataHosts, on a sender, are hosts (IP addresses or names, as
	// an Accept spells them) that an Accept may name for its data
	// connection besides the host of the session's control connection,
	// which is the only one allowed by default: a source sends blocks
	// only to the peer it authenticated (ErrAddress otherwise).
	AllowDataHosts []string
	// MaxPendingHellos caps the receiver's data connections accepted but
	// not through their first hello yet (DefaultMaxPendingHellos when
	// zero): at the cap, the oldest waiting connection of the host with
	// the most gives way to a new one from a host with fewer (one from
	// the busiest host is closed at once instead; Stats.RefusedBusy
	// counts both). A connection that carried a handoff of an
	// authenticated hello and waits, idle, for its next hello counts
	// under MaxIdleConns instead.
	MaxPendingHellos int
	// MaxPendingHellosPerHost caps those waiting connections per remote
	// host (an IPv4 address, an IPv6 /64; DefaultMaxPendingHellosPerHost
	// when zero): one more from that host is closed at once
	// (Stats.RefusedBusy).
	MaxPendingHellosPerHost int
	// MaxIdleConns caps idle data connections kept for later handoffs:
	// on a sender, per destination data address (DefaultMaxIdleConns when
	// zero); on a receiver, in all (DefaultReceiverIdleConns when zero):
	// one more is closed after its transfer. Negative turns reuse off: a
	// connection closes after its handoff (a dial per handoff).
	MaxIdleConns int
	// IdleTimeout is how long a sender keeps an idle data connection
	// (DefaultIdleTimeout when zero). A receiver waits for the next hello
	// on an idle connection twice as long, so that with the same setting
	// on both sides the sender, which picks connections, closes first.
	IdleTimeout time.Duration
	// StallTimeout is the transfers' progress timeout, on both sides: a
	// read that receives no byte, or a write that sends none, for that
	// long ends its transfer (ErrStalled; Stats.Stalled), whatever the
	// handoff's Deadline, none included. The loop's return is local
	// evidence like any other, so a frozen peer holds our blocks for at
	// most StallTimeout past its last byte. A streaming receiver waits
	// while the source's prefill computes: StallTimeout must cover the
	// longest pause between the parts the prefill marks written.
	// DefaultStallTimeout when zero or negative: it cannot be turned
	// off.
	StallTimeout time.Duration
}

func (c *Config) defaults() {
	if c.MaxPendingHellos <= 0 {
		c.MaxPendingHellos = DefaultMaxPendingHellos
	}
	if c.MaxPendingHellosPerHost <= 0 {
		c.MaxPendingHellosPerHost = DefaultMaxPendingHellosPerHost
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout = 5 * time.Second
	}
	if c.HelloTimeout <= 0 {
		c.HelloTimeout = 5 * time.Second
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = DefaultIdleTimeout
	}
	if c.StallTimeout <= 0 {
		c.StallTimeout = DefaultStallTimeout
	}
}

func (c *Config) wrap(conn net.Conn) net.Conn {
	if c.WrapConn != nil {
		return c.WrapConn(conn)
	}
	return conn
}
