package handoff

import (
	"errors"
	"fmt"
	"sync"
	"time"
)

// machine is one half's view of a handoff: the same states, table and
// History as the in-process Handoff. Its owner performs the effects of
// each move (aborting its lease, sending a message) after fire returns.
type machine struct {
	mu      sync.Mutex
	state   State
	history []Step
	tid     uint64        // the attached transfer's ID
	done    chan struct{} // closed on entering a final state
}

func newMachine() machine { return machine{done: make(chan struct{})} }

// fire applies e. It returns the edge's kind and the state it left.
// Called with m.mu held.
func (m *machine) fire(by string, e Event, err error) (edgeKind, State) {
	edge := next(m.state, e)
	from := m.state
	if edge.kind != edgeMove {
		return edge.kind, from
	}
	m.state = edge.to
	m.history = append(m.history, Step{From: from, To: edge.to, Event: e, By: by, Err: err, Transfer: m.tid, At: time.Now()})
	if edge.to.Final() {
		close(m.done)
	}
	return edgeMove, from
}

func (m *machine) lastErr() error { return m.history[len(m.history)-1].Err }

// Errors of the halves.
var (
	// ErrConnLost is the reason recorded when a half's control connection
	// ends while a handoff is not final.
	ErrConnLost = errors.New("kvlease: handoff control connection lost")
	// ErrPeer wraps an outcome the peer reported (its Done error, its
	// abort cause): the peer's words, not evidence about our memory.
	ErrPeer = errors.New("kvlease: handoff peer reported")
	// ErrUnconfirmed is recorded when the source's own transfer resolved
	// but the destination never reported its outcome before the deadline.
	ErrUnconfirmed = errors.New("kvlease: handoff destination never confirmed delivery")
)

// peerErr turns a peer's text into an error wrapping ErrPeer (and
// wrapped, when sentinel is not nil, that too).
func peerErr(what, text string, sentinel error) error {
	if sentinel != nil {
		return fmt.Errorf("kvlease: handoff: peer %s: %s: %w (%w)", what, text, ErrPeer, sentinel)
	}
	return fmt.Errorf("kvlease: handoff: peer %s: %s: %w", what, text, ErrPeer)
}

// HalfConfig configures either half of a cross-process handoff.
type HalfConfig struct {
	// Envelope is the envelope both processes agreed on; its Fingerprint
	// travels in every proposal.
	Envelope Envelope
	// Name and Peer name this side and the other in History ("prefill",
	// "decode"). They default to "source"/"destination" by side.
	Name, Peer string
	// Deadline bounds how long an attached transfer may stay unresolved
	// (and, on the source, how long the destination may take to report)
	// before the half gives up on evidence: DefaultDeadline when zero, no
	// deadline when negative.
	Deadline time.Duration
	// FrameTimeout bounds a control frame that has begun and every control
	// write (DefaultFrameTimeout when zero).
	FrameTimeout time.Duration
	// OnError, if set, is told every protocol error that changed nothing
	// (an unknown id, a message the state does not allow) and, on the
	// destination, every delivered block its pool would not seal. It is
	// called without the half's locks held, and must not block long.
	OnError func(error)
}

func (c *HalfConfig) defaults(name, peer string) error {
	if err := c.Envelope.Validate(); err != nil {
		return err
	}
	if c.Name == "" {
		c.Name = name
	}
	if c.Peer == "" {
		c.Peer = peer
	}
	if c.Deadline == 0 {
		c.Deadline = DefaultDeadline
	}
	if c.FrameTimeout <= 0 {
		c.FrameTimeout = DefaultFrameTimeout
	}
	return nil
}

func (c *HalfConfig) report(err error) {
	if c.OnError != nil {
		c.OnError(err)
	}
}

// deadlineTimer returns a channel that fires after d, or never for d < 0,
// and its stop function.
func deadlineTimer(d time.Duration) (<-chan time.Time, func()) {
	if d < 0 {
		return nil, func() {}
	}
	t := time.NewTimer(d)
	return t.C, func() { t.Stop() }
}
