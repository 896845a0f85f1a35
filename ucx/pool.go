package ucx

import (
	"sync"
	"time"

	"github.com/kvlease/kvlease/handoff"
)

// Reused connections (the push model). A handoff to a peer already
// connected costs no worker creation and no handshake: a connection (a
// worker and its endpoint to the peer's worker) is checked out by one
// handoff at a time, and goes back to its session's idle list only when
// that handoff ended cleanly on this side (the source: the destination's
// done and every send of the handoff completed; the destination: every
// receive it posted completed and every block passed its check). Any
// other end destroys it, as before reuse: the revocation is still the
// worker's destruction, and nothing of a handoff that ended badly can
// reach a later one through it. Each handoff still draws its own tag salt
// (unique on its worker), nonce and keys.

const (
	// defaultMaxIdle is Config.MaxIdle's default.
	defaultMaxIdle = 4
	// defaultSenderIdle and defaultReceiverIdle are Config.IdleTimeout's
	// defaults: the destination keeps an idle worker longer than the
	// source keeps its endpoint to it, so the source drops its end first.
	defaultSenderIdle   = 30 * time.Second
	defaultReceiverIdle = 60 * time.Second
	// settleTimeout bounds how long a source waits, after the
	// destination's done, for its own sends to complete before it
	// revokes the connection instead of keeping it.
	settleTimeout = 5 * time.Second
)

// poolKey is the peer a connection serves: the control session (its
// local number and its authenticated peer). A connection, and the
// address of its worker, is never used for another session.
type poolKey struct {
	session uint64
	peer    *handoff.Peer
}

func keyOf(id handoff.PlaneID) poolKey { return poolKey{id.Session, id.Peer} }

// conn is a connection of the push model: a worker of this side, its
// address, and an endpoint to the peer's worker (nil on a destination's
// fresh worker until a source names itself).
type conn struct {
	w    *worker
	own  []byte // this worker's address
	ep   *endpoint
	peer string // the address ep connects to
	salt uint32 // destination: the next handoff's tag salt
	dest bool   // a destination's worker
}

// destroy closes the endpoint (forced) and destroys the worker after a
// bounded flush of its handshakes (see worker.settle).
func (c *conn) destroy() {
	c.w.destroy(func() {
		if c.ep != nil {
			_ = c.w.closeEP(c.ep, true)
			c.ep = nil
		}
		c.w.settle()
	})
}

// healthy reports, from any thread, whether c's endpoint (if it has
// one) has not failed. Only for a connection the caller holds.
func (c *conn) healthy() bool { return c.ep == nil || c.ep.failed() == nil }

// broken reports whether c's endpoint failed (or its worker is gone).
// A destination's worker whose endpoint to its last source failed (the
// source dropped its end) is not broken: the endpoint is closed and the
// worker waits for the session's next source. Only for a connection
// that no handoff holds.
func (c *conn) broken() bool {
	bad := true
	_ = c.w.call(func() {
		bad = c.ep != nil && c.ep.failed() != nil
		if bad && c.dest {
			_ = c.w.closeEP(c.ep, true)
			c.ep, c.peer, bad = nil, "", false
		}
	})
	return bad
}

type idleEntry struct {
	c     *conn
	since time.Time
}

// pool is a side's idle connections, per session: at most max each,
// each destroyed after ttl idle or once its endpoint fails. max < 0
// keeps none.
type pool struct {
	max   int
	ttl   time.Duration
	stats *counters

	mu      sync.Mutex
	idle    map[poolKey][]idleEntry
	n       int
	closed  bool
	running bool // the janitor runs
	wg      sync.WaitGroup
	stop    chan struct{}
}

func newPool(max int, ttl time.Duration, stats *counters) *pool {
	return &pool{max: max, ttl: ttl, stats: stats, idle: map[poolKey][]idleEntry{}, stop: make(chan struct{})}
}

// take checks out the most recently idle connection of k that match
// accepts (nil: any), or returns nil.
func (p *pool) take(k poolKey, match func(*conn) bool) *conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	list := p.idle[k]
	for i := len(list) - 1; i >= 0; i-- {
		if match == nil || match(list[i].c) {
			c := list[i].c
			list = append(list[:i], list[i+1:]...)
			if len(list) == 0 {
				delete(p.idle, k)
			} else {
				p.idle[k] = list
			}
			p.n--
			return c
		}
	}
	return nil
}

// put returns c to k's idle list; the oldest beyond max, or c itself
// when the pool is closed or keeps none, is destroyed.
func (p *pool) put(k poolKey, c *conn) {
	p.mu.Lock()
	if p.closed || p.max < 0 {
		p.mu.Unlock()
		c.destroy()
		return
	}
	list := append(p.idle[k], idleEntry{c: c, since: time.Now()})
	var evict []*conn
	for len(list) > max(p.max, 1) {
		evict = append(evict, list[0].c)
		list = list[1:]
	}
	p.idle[k] = list
	p.n += 1 - len(evict)
	if !p.running {
		p.running = true
		p.wg.Add(1)
		go p.janitor()
	}
	p.mu.Unlock()
	for _, c := range evict {
		c.destroy()
	}
}

// idleN returns how many connections are idle.
func (p *pool) idleN() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n
}

// janitor destroys the connections idle past ttl (Stats.Expired) and
// those whose endpoint failed (Stats.Broken), until the pool is empty
// or closed.
func (p *pool) janitor() {
	defer p.wg.Done()
	tick := min(max(p.ttl/4, 5*time.Millisecond), time.Second)
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
		}
		// Under the lock: only connections no handoff holds are checked
		// (a worker's thread never takes the pool's lock).
		now := time.Now()
		var expired, broken []*conn
		p.mu.Lock()
		for k, list := range p.idle {
			keep := list[:0]
			for _, e := range list {
				switch {
				case now.Sub(e.since) >= p.ttl:
					expired = append(expired, e.c)
				case e.c.broken():
					broken = append(broken, e.c)
				default:
					keep = append(keep, e)
				}
			}
			if len(keep) == 0 {
				delete(p.idle, k)
			} else {
				p.idle[k] = keep
			}
		}
		p.n -= len(expired) + len(broken)
		p.mu.Unlock()
		for _, c := range expired {
			c.destroy()
		}
		for _, c := range broken {
			c.destroy()
		}
		if len(expired)+len(broken) > 0 {
			p.stats.add(func(s *Stats) { s.Expired += len(expired); s.Broken += len(broken) })
		}
		p.mu.Lock()
		if p.n == 0 || p.closed {
			p.running = false
			p.mu.Unlock()
			return
		}
		p.mu.Unlock()
	}
}

// close destroys every idle connection and stops the janitor; a
// connection put afterwards is destroyed at once.
func (p *pool) close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	var all []*conn
	for _, list := range p.idle {
		for _, e := range list {
			all = append(all, e.c)
		}
	}
	clear(p.idle)
	p.n = 0
	close(p.stop)
	p.mu.Unlock()
	p.wg.Wait()
	for _, c := range all {
		c.destroy()
	}
}
