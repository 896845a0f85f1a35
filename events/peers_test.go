package events

import (
	"net"
	"testing"

	"github.com/stretchr/testify/require"
)

// peerModel is the rule peerTable implements, written the slow way: a
// list of (address, connection, age) in admission order.
type peerModel struct {
	perAddr, total int
	held           []peerModelEntry
}

type peerModelEntry struct {
	addr string
	c    int
}

func (m *peerModel) count(addr string) int {
	n := 0
	for _, e := range m.held {
		if e.addr == addr {
			n++
		}
	}
	return n
}

// admit returns the displaced connection (-1: none) and whether c got in.
func (m *peerModel) admit(addr string, c int) (int, bool) {
	mine := m.count(addr)
	if mine >= m.perAddr || m.total <= 0 {
		return -1, false
	}
	victim := -1
	if len(m.held) >= m.total {
		most := 0
		for _, e := range m.held {
			most = max(most, m.count(e.addr))
		}
		if most <= mine {
			return -1, false
		}
		// The oldest connection among the addresses that hold most.
		for i, e := range m.held {
			if m.count(e.addr) == most {
				victim = e.c
				m.held = append(m.held[:i], m.held[i+1:]...)
				break
			}
		}
	}
	m.held = append(m.held, peerModelEntry{addr, c})
	return victim, true
}

func (m *peerModel) remove(c int) (string, bool) {
	for i, e := range m.held {
		if e.c == c {
			m.held = append(m.held[:i], m.held[i+1:]...)
			return e.addr, true
		}
	}
	return "", false
}

// FuzzPeerTable runs admissions and removals from a few addresses
// against the model: the same decisions, the same victims, and the caps
// hold after every step.
func FuzzPeerTable(f *testing.F) {
	f.Add(uint8(2), uint8(4), []byte{0, 0, 0, 0, 1, 1, 0x80, 2})
	f.Add(uint8(8), uint8(3), []byte{0, 0, 0, 1, 2, 3, 3, 0x81, 4})
	f.Add(uint8(1), uint8(1), []byte{0, 1, 0x80, 1})
	f.Fuzz(func(t *testing.T, perAddr, total uint8, ops []byte) {
		p, n := int(perAddr%10), int(total%12)
		tb := newPeerTable[int](p, n)
		m := &peerModel{perAddr: p, total: n}
		addrs := []string{"a", "b", "c", "d", "e"}
		next := 0
		for _, op := range ops {
			if op&0x80 != 0 { // remove the op&0x7f-th connection ever admitted, if held
				c := int(op & 0x7f)
				addr, held := m.remove(c)
				if !held {
					addr = "a"
				}
				require.Equal(t, held, tb.remove(addr, c), "remove %d", c)
				continue
			}
			addr := addrs[int(op)%len(addrs)]
			victim, hasVictim, ok := tb.admit(addr, next)
			wantVictim, wantOK := m.admit(addr, next)
			require.Equal(t, wantOK, ok, "admit %d from %s", next, addr)
			require.Equal(t, wantVictim >= 0, hasVictim)
			if hasVictim {
				require.Equal(t, wantVictim, victim)
			}
			next++
			require.Equal(t, len(m.held), tb.len())
			require.LessOrEqual(t, tb.len(), max(n, 0))
			for _, a := range addrs {
				require.LessOrEqual(t, m.count(a), p)
				require.Len(t, tb.byAddr[a], m.count(a))
			}
		}
	})
}

func TestPeerAddr(t *testing.T) {
	for _, c := range []struct {
		addr net.Addr
		want string
	}{
		{&net.TCPAddr{IP: net.IPv4(127, 0, 0, 2), Port: 1}, "127.0.0.2"},
		{&net.TCPAddr{IP: net.ParseIP("::ffff:10.0.0.1"), Port: 1}, "10.0.0.1"},
		{&net.TCPAddr{IP: net.IPv6loopback, Port: 1}, "::1"},
		{&net.TCPAddr{IP: net.ParseIP("2001:db8:1:2:3:4:5:6"), Port: 1}, "2001:db8:1:2::/64"},
		{&net.TCPAddr{IP: net.ParseIP("2001:db8:1:2:ffff::1"), Port: 9}, "2001:db8:1:2::/64"},
		{&net.UnixAddr{Name: "@x", Net: "unix"}, "local"},
	} {
		require.Equal(t, c.want, peerAddr(addrConn{remote: c.addr}), "%v", c.addr)
	}
}

// addrConn is a net.Conn that only has a remote address.
type addrConn struct {
	net.Conn
	remote net.Addr
}

func (c addrConn) RemoteAddr() net.Addr { return c.remote }
