// Package pending bounds the connections a listener holds before they
// have proved anything (a handshake in progress, a data connection that
// has not said its hello yet), per remote address and in total, so that
// one address that floods cannot keep another out.
//
// The rule: a new connection from an address that already holds perAddr
// pending connections is refused; when total are pending, the oldest
// pending connection of the busiest address gives way to the new one,
// unless the new one's own address is (one of) the busiest, in which
// case the new one is refused. An address with fewer pending connections
// than the busiest therefore always gets in, however many connections
// the others hold or redial.
//
// Addresses are keyed by host: an IPv4 address as it is, an IPv6 address
// by its /64 (what one host is usually given), anything else (a pipe, a
// Unix socket) by its network and string.
package pending

import (
	"io"
	"net"
	"sync"
)

// Set is the pending connections of one listener. Its methods are safe
// for concurrent use.
type Set struct {
	total, perAddr int

	mu    sync.Mutex
	n     int
	seq   uint64
	addrs map[string]*addr
}

// addr is one remote host's pending connections, oldest first.
type addr struct {
	key string
	q   []*Ticket
}

// Ticket is one admitted connection's place in the Set, until Release.
type Ticket struct {
	s       *Set
	a       *addr
	c       io.Closer
	seq     uint64
	gone    bool // released or given way (under s.mu)
	evicted bool
}

// New returns a Set that holds at most total pending connections, at
// most perAddr of them from one address (both at least 1).
func New(total, perAddr int) *Set {
	return &Set{total: max(total, 1), perAddr: max(min(perAddr, total), 1), addrs: make(map[string]*addr)}
}

// Key is the address key remote is counted under.
func Key(remote net.Addr) string {
	if ta, ok := remote.(*net.TCPAddr); ok {
		if ip4 := ta.IP.To4(); ip4 != nil {
			return ip4.String()
		}
		if len(ta.IP) == net.IPv6len {
			return ta.IP.Mask(net.CIDRMask(64, 128)).String() + "/64"
		}
	}
	if remote == nil {
		return ""
	}
	return remote.Network() + ":" + remote.String()
}

// Admit takes a place for the connection c from remote. It returns nil
// when c is refused (the caller closes it and counts it). gaveWay reports
// that another pending connection was closed to make room (the caller
// counts it; that connection's Release then returns false).
func (s *Set) Admit(remote net.Addr, c io.Closer) (t *Ticket, gaveWay bool) {
	key := Key(remote)
	s.mu.Lock()
	a := s.addrs[key]
	if a != nil && len(a.q) >= s.perAddr {
		s.mu.Unlock()
		return nil, false
	}
	var victim *Ticket
	if s.n >= s.total {
		busiest := s.busiest()
		if busiest == nil || (a != nil && len(a.q) >= len(busiest.q)) {
			s.mu.Unlock()
			return nil, false
		}
		victim = busiest.q[0]
		victim.evicted = true
		s.remove(victim)
	}
	if a == nil {
		a = &addr{key: key}
		s.addrs[key] = a
	}
	s.seq++
	t = &Ticket{s: s, a: a, c: c, seq: s.seq}
	a.q = append(a.q, t)
	s.n++
	s.mu.Unlock()
	if victim != nil {
		_ = victim.c.Close()
	}
	return t, victim != nil
}

// busiest returns the address with the most pending connections, the one
// whose oldest is oldest among equals. Called with s.mu held.
func (s *Set) busiest() *addr {
	var b *addr
	for _, a := range s.addrs {
		if b == nil || len(a.q) > len(b.q) || (len(a.q) == len(b.q) && a.q[0].seq < b.q[0].seq) {
			b = a
		}
	}
	return b
}

// remove takes t out of its address's queue. Called with s.mu held.
func (s *Set) remove(t *Ticket) {
	t.gone = true
	a := t.a
	for i, u := range a.q {
		if u == t {
			a.q = append(a.q[:i], a.q[i+1:]...)
			break
		}
	}
	if len(a.q) == 0 {
		delete(s.addrs, a.key)
	}
	s.n--
}

// Release gives the place back once the connection is through (or has
// failed). It reports false when the connection had been closed to give
// way to a newer one: its failure is then that, not its own. Idempotent.
func (t *Ticket) Release() bool {
	s := t.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if !t.gone {
		s.remove(t)
	}
	return !t.evicted
}

// Len returns how many connections are pending.
func (s *Set) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}
