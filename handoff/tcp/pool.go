package tcp

import (
	"fmt"
	"net"
	"time"

	"github.com/kvlease/kvlease/handoff"
)

// Reused data connections. A Sender keeps, per destination data address,
// up to Config.MaxIdleConns idle data connections (most recently used
// first); a handoff takes one, or dials when none is idle (active
// connections are not capped: one per handoff in flight). Every handoff
// still opens with its own hello (its token and the HMAC bound to its
// session), so a reused connection proves each handoff's session again,
// and a receiver refuses a forged or replayed hello on it as on a fresh
// one.
//
// A connection goes back to the pool only when both sides are known to
// be at a handoff boundary: the writer wrote every byte (no error, no
// cancel: never mid-frame) and the destination's word on the handoff was
// nil (Finish(id, nil): its reader read and checked every byte, so it is
// waiting for the next hello, or closed the connection before it
// answered). Any error, cancel, partial write or bad word closes it.
// While it waits for the word the connection is parked: at most
// MaxIdleConns per address are idle or parked (one more is closed at
// once), and a parked one is closed once IdleTimeout passes without the
// word (a sender used without Finish, outside package handoff's halves,
// reuses nothing).
//
// Before a handoff uses an idle connection it peeks at it without
// waiting (Linux: MSG_PEEK|MSG_DONTWAIT): a receiver never writes on a
// data connection, so a FIN, a reset or stray bytes mean the peer is
// done with it, and the handoff dials instead (Stats.Stale). A receiver
// closes a connection before it resolves its transfer and answers, so on
// the word's arrival its FIN is normally there to be seen. Should the
// hello's write still fail on a reused connection (the FIN was still on
// its way), the handoff dials once more and sends again: nothing of the
// regions was read yet and the receiver has not taken the token, so the
// evidence is as clean as for a first dial. A connection that breaks
// later fails only the handoff on it (its evidence rules unchanged);
// the next handoff dials.
//
// Idle expiry. The sender closes a connection idle for IdleTimeout
// (Stats.IdleExpired); the receiver waits for the next hello on an idle
// connection for twice the IdleTimeout of its own Config. With the same
// IdleTimeout on both sides (or a receiver's at least a sender's) the
// sender, which picks the connections, always closes first, and never
// hands a handoff a connection the receiver is closing for idleness.

type connState uint8

const (
	connActive connState = iota // carrying a handoff
	connParked                  // written cleanly, waiting for the destination's word
	connIdle                    // in the pool
	connClosed
)

// word is the destination's word on a handoff, as Finish reported it
// while the writer still ran.
type word uint8

const (
	wordNone word = iota
	wordOK
	wordBad
)

// sconn is one of a sender's data connections.
type sconn struct {
	c, raw net.Conn // wrapped (what the writer uses), raw (peeked, closed)
	addr   string
	// Under Sender.mu.
	state   connState
	id      handoff.PlaneID // the handoff it carries or is parked for
	word    word
	expires time.Time // when idle or parked: when the timer closes it
	timer   *time.Timer
}

// get takes an idle connection to addr that is still alive, or dials
// one. reused says which.
func (s *Sender) get(addr string) (sc *sconn, reused bool, err error) {
	for {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return nil, false, fmt.Errorf("tcp: send: %w", ErrClosed)
		}
		l := s.idle[addr]
		if len(l) == 0 {
			s.mu.Unlock()
			break
		}
		sc = l[len(l)-1]
		l[len(l)-1] = nil
		if l = l[:len(l)-1]; len(l) == 0 {
			delete(s.idle, addr)
		} else {
			s.idle[addr] = l
		}
		sc.state = connActive
		s.mu.Unlock()
		if alive(sc.raw) {
			s.stats.mu.Lock()
			s.stats.s.Reuses++
			s.stats.mu.Unlock()
			return sc, true, nil
		}
		s.stats.mu.Lock()
		s.stats.s.Stale++
		s.stats.mu.Unlock()
		s.drop(sc)
	}
	sc, err = s.dial(addr)
	return sc, false, err
}

// dial opens a data connection to addr.
func (s *Sender) dial(addr string) (*sconn, error) {
	raw, err := net.DialTimeout("tcp", addr, s.cfg.DialTimeout)
	if err != nil {
		return nil, fmt.Errorf("tcp: dial %s: %w", addr, err)
	}
	sc := &sconn{c: s.cfg.wrap(raw), raw: raw, addr: addr}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		sc.close()
		return nil, fmt.Errorf("tcp: send: %w", ErrClosed)
	}
	s.conns[sc] = struct{}{}
	s.mu.Unlock()
	s.stats.mu.Lock()
	s.stats.s.Dials++
	s.stats.mu.Unlock()
	return sc, nil
}

func (sc *sconn) close() {
	_ = sc.c.Close()
	_ = sc.raw.Close()
}

// drop closes sc and forgets it.
func (s *Sender) drop(sc *sconn) {
	s.mu.Lock()
	s.forget(sc)
	s.mu.Unlock()
	sc.close()
}

// forget marks sc closed and takes it out of every index (under s.mu);
// the caller closes it.
func (s *Sender) forget(sc *sconn) {
	delete(s.conns, sc)
	if s.byID[sc.id] == sc {
		delete(s.byID, sc.id)
	}
	if sc.state == connIdle {
		l := s.idle[sc.addr]
		for i, o := range l {
			if o == sc {
				l = append(l[:i], l[i+1:]...)
				break
			}
		}
		if len(l) == 0 {
			delete(s.idle, sc.addr)
		} else {
			s.idle[sc.addr] = l
		}
	}
	if sc.state == connParked {
		s.unpark(sc)
	}
	sc.state = connClosed
	if sc.timer != nil {
		sc.timer.Stop()
	}
}

// toIdle puts sc in its address's pool (under s.mu); it reports false,
// and forgets sc, when the pool is full, reuse is off or the sender is
// closed: the caller closes it then.
func (s *Sender) toIdle(sc *sconn) bool {
	if s.closed || s.cfg.MaxIdleConns < 0 || len(s.idle[sc.addr]) >= s.cfg.MaxIdleConns {
		s.forget(sc)
		return false
	}
	if s.byID[sc.id] == sc {
		delete(s.byID, sc.id)
	}
	if sc.state == connParked {
		s.unpark(sc)
	}
	s.idle[sc.addr] = append(s.idle[sc.addr], sc)
	sc.state, sc.word = connIdle, wordNone
	s.arm(sc)
	return true
}

// arm starts sc's idle (or parked) timer (under s.mu).
func (s *Sender) arm(sc *sconn) {
	d := s.cfg.IdleTimeout
	sc.expires = time.Now().Add(d)
	if sc.timer == nil {
		sc.timer = time.AfterFunc(d, func() { s.expire(sc) })
	} else {
		sc.timer.Reset(d)
	}
}

// expire closes sc if it is still idle or parked and its time is up (a
// timer that fired late for an earlier stay finds it taken or re-armed).
func (s *Sender) expire(sc *sconn) {
	s.mu.Lock()
	if (sc.state != connIdle && sc.state != connParked) || time.Now().Before(sc.expires) {
		s.mu.Unlock()
		return
	}
	s.forget(sc)
	s.mu.Unlock()
	sc.close()
	s.stats.mu.Lock()
	s.stats.s.IdleExpired++
	s.stats.mu.Unlock()
}

// unpark counts sc out of its address's parked connections (under s.mu).
func (s *Sender) unpark(sc *sconn) {
	if s.parked[sc.addr]--; s.parked[sc.addr] <= 0 {
		delete(s.parked, sc.addr)
	}
}

// carry registers sc as carrying handoff id (for Finish).
func (s *Sender) carry(sc *sconn, id handoff.PlaneID) {
	s.mu.Lock()
	sc.id, sc.word, sc.state = id, wordNone, connActive
	if _, dup := s.byID[id]; !dup {
		s.byID[id] = sc
	}
	s.mu.Unlock()
}

// replace hands handoff id from old (closed) to fresh.
func (s *Sender) replace(old, fresh *sconn) {
	s.mu.Lock()
	reg := s.byID[old.id] == old
	s.forget(old)
	fresh.id, fresh.word, fresh.state = old.id, old.word, connActive
	if reg {
		s.byID[fresh.id] = fresh
	}
	s.mu.Unlock()
	old.close()
}

// ended is told that the writer on sc returned, cleanly (every byte
// written, no cancel) or not. A clean connection goes back to the pool
// once the destination's word is nil (now, if Finish came first, or
// when it comes); anything else closes it.
func (s *Sender) ended(sc *sconn, clean bool) {
	s.mu.Lock()
	reg := s.byID[sc.id] == sc
	keep := false
	switch {
	case !clean || !reg || sc.word == wordBad || s.closed || s.cfg.MaxIdleConns < 0:
		s.forget(sc)
	case sc.word == wordOK:
		keep = s.toIdle(sc)
	case len(s.idle[sc.addr])+s.parked[sc.addr] >= s.cfg.MaxIdleConns:
		// As many wait for their word as the pool could take.
		s.forget(sc)
	default:
		sc.state = connParked
		s.parked[sc.addr]++
		s.arm(sc)
		keep = true
	}
	s.mu.Unlock()
	if !keep {
		sc.close()
	}
}

// Finish implements handoff.SendPlane: the destination's word on id
// decides whether the connection that carried it goes back to the pool
// (nil, and its writer finished cleanly) or is closed. The transfer's
// evidence does not depend on it (a push plane has its own).
func (s *Sender) Finish(id handoff.PlaneID, peer error) {
	s.mu.Lock()
	sc := s.byID[id]
	if sc == nil {
		s.mu.Unlock()
		return
	}
	if sc.state == connActive {
		sc.word = wordOK
		if peer != nil {
			sc.word = wordBad
		}
		s.mu.Unlock()
		return
	}
	keep := false
	if peer == nil {
		keep = s.toIdle(sc)
	} else {
		s.forget(sc)
	}
	s.mu.Unlock()
	if !keep {
		sc.close()
	}
}
