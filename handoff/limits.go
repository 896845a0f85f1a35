package handoff

import (
	"fmt"
	"sync"
	"time"

	"github.com/kvlease/kvlease/internal/pending"
	"go.uber.org/atomic"
)

// Limits caps what one identity holds with a Destination across all its
// sessions at once (DestinationConfig.IdentityLimits). A zero field
// takes its default; a negative one means no cap.
type Limits struct {
	// Blocks caps the blocks the identity's handoffs hold in the pool
	// until they are final, prefix hits included (MaxSessionBlocks by
	// default, which is half the pool's capacity by default: a fair
	// share, so that no one identity, however many sessions it opens,
	// can take the pool from the others). A proposal past it is rejected
	// with ErrLimit.
	Blocks int
	// Handoffs caps the identity's handoffs that are not final
	// (MaxHandoffs by default); a proposal past it is rejected with
	// ErrLimit.
	Handoffs int
	// Sessions caps the identity's control sessions
	// (DefaultIdentitySessions by default); one more is refused at the
	// end of its handshake (the source's NewSource fails with ErrLimit).
	Sessions int
}

// Defaults of DestinationConfig's session bounds.
const (
	// DefaultMaxSessions is DestinationConfig.MaxSessions when zero.
	DefaultMaxSessions = 1024
	// DefaultIdentitySessions is Limits.Sessions when zero.
	DefaultIdentitySessions = 256
	// DefaultSessionIdleTimeout is DestinationConfig.SessionIdleTimeout
	// when zero.
	DefaultSessionIdleTimeout = 5 * time.Minute
)

// maxPendingHandshakesPerHost is how many of Listen's pending handshakes
// may come from one host (an IPv4 address, an IPv6 /64); one more from
// it is closed at once (HalfStats.Busy).
const maxPendingHandshakesPerHost = 16

// identity is what one identity holds across its sessions. sessions is
// guarded by the destination's sessions lock; inflight and held are
// atomics, counted down when a handoff becomes final.
type identity struct {
	key              string
	blocks, handoffs int64 // its caps
	sessionCap       int
	sessions         int
	inflight, held   atomic.Int64
}

// sessionTable is a destination's live sessions by identity.
type sessionTable struct {
	mu    sync.Mutex
	total int
	ids   map[string]*identity
}

// identityKey is the key a peer is counted under: its authenticated
// identity, or for an insecure session "addr:" and its host.
func identityKey(p *Peer) string {
	if p.Identity != "" {
		return p.Identity
	}
	return "addr:" + pending.Key(p.Addr)
}

// limitsFor resolves key's caps: IdentityLimits' answer, defaults for
// zero fields, noCap for negative ones.
func (d *Destination[R]) limitsFor(key string) (blocks, handoffs, sessions int) {
	var l Limits
	if d.cfg.IdentityLimits != nil {
		l = d.cfg.IdentityLimits(key)
	}
	pick := func(v, def int) int {
		switch {
		case v == 0:
			return def
		case v < 0:
			return noCap
		}
		return v
	}
	return pick(l.Blocks, d.cfg.MaxSessionBlocks), pick(l.Handoffs, d.cfg.MaxHandoffs), pick(l.Sessions, DefaultIdentitySessions)
}

// join admits a session of p under MaxSessions and its identity's
// Sessions cap, or refuses it (an error wrapping ErrLimit).
func (d *Destination[R]) join(p *Peer) (*identity, error) {
	key := identityKey(p)
	blocks, handoffs, sessions := d.limitsFor(key)
	t := &d.sessions
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.total >= d.cfg.MaxSessions {
		return nil, fmt.Errorf("kvlease: handoff destination: %d sessions, at most %d (MaxSessions): %w", t.total, d.cfg.MaxSessions, ErrLimit)
	}
	id := t.ids[key]
	if id == nil {
		id = &identity{key: key, blocks: int64(blocks), handoffs: int64(handoffs), sessionCap: sessions}
		if t.ids == nil {
			t.ids = make(map[string]*identity)
		}
		t.ids[key] = id
	}
	if id.sessions >= id.sessionCap {
		d.dropIdle(id)
		return nil, fmt.Errorf("kvlease: handoff destination: %s has %d sessions, at most %d: %w", key, id.sessions, id.sessionCap, ErrLimit)
	}
	id.sessions++
	t.total++
	return id, nil
}

// leave ends a session of id.
func (d *Destination[R]) leave(id *identity) {
	t := &d.sessions
	t.mu.Lock()
	id.sessions--
	t.total--
	d.dropIdle(id)
	t.mu.Unlock()
}

// dropIdle forgets id once it has no session and nothing in flight.
// Called with the sessions lock held; a handoff that becomes final after
// its session ended calls it through done.
func (d *Destination[R]) dropIdle(id *identity) {
	if id.sessions == 0 && id.inflight.Load() == 0 && d.sessions.ids[id.key] == id {
		delete(d.sessions.ids, id.key)
	}
}

// take counts a proposal of n blocks against id's caps, or refuses it
// (an error wrapping ErrLimit, nothing counted). Sessions of one
// identity race here: a refusal may be spurious while another's
// proposal is being counted, never an excess.
func (id *identity) take(hid uint64, n int64) error {
	if f := id.inflight.Add(1); f > id.handoffs {
		id.inflight.Add(-1)
		return fmt.Errorf("kvlease: handoff %d: %s has %d handoffs in flight, at most %d: %w", hid, id.key, f-1, id.handoffs, ErrLimit)
	}
	if h := id.held.Add(n); h > id.blocks {
		id.held.Add(-n)
		id.inflight.Add(-1)
		return fmt.Errorf("kvlease: handoff %d: %d more blocks would make %s hold %d, at most %d: %w", hid, n, id.key, h, id.blocks, ErrLimit)
	}
	return nil
}

// done counts down a handoff of n blocks of id that became final.
func (d *Destination[R]) done(id *identity, n int64) {
	id.held.Add(-n)
	if id.inflight.Add(-1) == 0 {
		d.sessions.mu.Lock()
		d.dropIdle(id)
		d.sessions.mu.Unlock()
	}
}

// watchIdle arms the session's idle timer (SessionIdleTimeout > 0).
func (s *session[R]) watchIdle() {
	timeout := s.d.cfg.SessionIdleTimeout
	if timeout <= 0 {
		return
	}
	s.idleSince.Store(time.Now().UnixNano())
	s.mu.Lock()
	s.idle = time.AfterFunc(timeout, s.idleCheck)
	s.mu.Unlock()
}

// idleCheck is the idle timer's handler: it closes the session if
// nothing was in flight since SessionIdleTimeout ago, else checks again
// when that could first be so.
func (s *session[R]) idleCheck() {
	timeout := s.d.cfg.SessionIdleTimeout
	next := timeout
	if s.inflight.Load() == 0 {
		idle := time.Duration(time.Now().UnixNano() - s.idleSince.Load())
		if idle >= timeout {
			if s.closing.CompareAndSwap(nil, &closeCause{fmt.Errorf("%w: nothing in flight for %v (SessionIdleTimeout)", errIdle, timeout)}) {
				s.d.stats.idleClosed.Add(1)
				_ = s.c.Close() // the read loop ends the session
			}
			return
		}
		next = timeout - idle
	}
	s.mu.Lock()
	if s.lost == nil {
		s.idle.Reset(next)
	}
	s.mu.Unlock()
}

// closeCause is why the destination itself closed a session.
type closeCause struct{ err error }
