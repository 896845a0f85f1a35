package tcp

import (
	"errors"
	"sync"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// counters is a plane's count of what it did, under one mutex.
type counters struct {
	mu sync.Mutex
	s  handoff.PlaneStats
}

func (c *counters) outcome(err error, bytes int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.s.Bytes += bytes
	switch {
	case err == nil:
		c.s.Completed++
	case errors.Is(err, kvlease.ErrCanceled):
		c.s.Canceled++
	default:
		c.s.Failed++
		if errors.Is(err, ErrStalled) {
			c.s.Stalled++
		}
	}
}

// Stats returns what the sender did.
func (s *Sender) Stats() handoff.PlaneStats {
	s.mu.Lock()
	idle := 0
	for _, l := range s.idle {
		idle += len(l)
	}
	s.mu.Unlock()
	s.stats.mu.Lock()
	defer s.stats.mu.Unlock()
	st := s.stats.s
	st.Idle = idle
	return st
}

// Stats returns what the receiver did.
func (r *Receiver) Stats() handoff.PlaneStats {
	r.stats.mu.Lock()
	defer r.stats.mu.Unlock()
	st := r.stats.s
	st.Idle = int(r.idle.Load())
	return st
}
