package events

import (
	"net"
	"slices"
)

// peerTable bounds the connections a socket holds in one state (in their
// handshake, or established) by remote address as well as in total, so
// that a flood from one address cannot lock the others out:
//
//   - an address holds at most perAddr connections; one more is refused;
//   - when total are held, a connection from an address that holds fewer
//     than the busiest address takes the place of the oldest connection
//     of the busiest address (of the busiest addresses, the one whose
//     oldest connection is the oldest), which the caller closes;
//     otherwise it is refused.
//
// So an address that holds fewer connections than another always gets
// in, however many the others opened or redial as they are closed, and
// a new connection is displaced only after every older one of an
// address as busy. The table is a few slices under the socket's lock;
// what it holds is small (total is tens), so finding the busiest address
// is a scan.
type peerTable[T comparable] struct {
	perAddr, total int
	n              int
	seq            uint64                    // admissions so far: each entry's age
	byAddr         map[string][]peerEntry[T] // each address's connections, oldest first
}

type peerEntry[T comparable] struct {
	c   T
	seq uint64
}

func newPeerTable[T comparable](perAddr, total int) peerTable[T] {
	return peerTable[T]{perAddr: perAddr, total: total, byAddr: map[string][]peerEntry[T]{}}
}

// admit adds c under addr. ok is false when c is refused; when c took
// the place of another connection, displaced is that one (hasVictim
// true): it is no longer in the table and the caller must close it.
func (t *peerTable[T]) admit(addr string, c T) (displaced T, hasVictim, ok bool) {
	mine := len(t.byAddr[addr])
	if mine >= t.perAddr || t.total <= 0 {
		return displaced, false, false
	}
	if t.n >= t.total {
		var busiest string
		var victim peerEntry[T]
		most := 0
		for a, es := range t.byAddr {
			if len(es) > most || (len(es) == most && es[0].seq < victim.seq) {
				busiest, victim, most = a, es[0], len(es)
			}
		}
		if most <= mine {
			return displaced, false, false // our address already holds as many as any
		}
		t.remove(busiest, victim.c)
		displaced, hasVictim = victim.c, true
	}
	t.seq++
	t.byAddr[addr] = append(t.byAddr[addr], peerEntry[T]{c: c, seq: t.seq})
	t.n++
	return displaced, hasVictim, true
}

// remove takes c out of the table; false if it was not there (already
// removed, or displaced).
func (t *peerTable[T]) remove(addr string, c T) bool {
	es := t.byAddr[addr]
	i := slices.IndexFunc(es, func(e peerEntry[T]) bool { return e.c == c })
	if i < 0 {
		return false
	}
	es = slices.Delete(es, i, i+1)
	if len(es) == 0 {
		delete(t.byAddr, addr)
	} else {
		t.byAddr[addr] = es
	}
	t.n--
	return true
}

// len is how many connections the table holds.
func (t *peerTable[T]) len() int { return t.n }

// each calls f for every connection held.
func (t *peerTable[T]) each(f func(T)) {
	for _, es := range t.byAddr {
		for _, e := range es {
			f(e.c)
		}
	}
}

// peerAddr is the key a connection is counted under: its remote IP for
// TCP (an IPv6 address by its /64, what one host is usually given), and
// one key for every connection of a unix socket (who may connect is
// decided by the file's permissions).
func peerAddr(c net.Conn) string {
	a, ok := c.RemoteAddr().(*net.TCPAddr)
	if !ok {
		return "local"
	}
	if ip4 := a.IP.To4(); ip4 != nil {
		return ip4.String()
	}
	if a.IP.IsLoopback() {
		return a.IP.String()
	}
	return a.IP.Mask(net.CIDRMask(64, 128)).String() + "/64"
}
