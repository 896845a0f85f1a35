package ucx

import (
	"sync"
	"time"

	"go.uber.org/atomic"
)

// The progress timeout (Config.StallTimeout). Every attached transfer has
// a stall clock: the job's worker thread marks progress on it (a send,
// receive or get posted or completed, at most Config.Window outstanding;
// the pull source, any progress of its worker; a streaming source, its
// wait for its own prefill with nothing outstanding), and a goroutine of
// the transfer's own wakes when the timeout may have passed. Once StallTimeout passed with no progress
// it ends the transfer through the path a cancel takes, whatever the
// handoff's Deadline, none included:
//
//   - source: the revocation (the handoff's endpoint closed, its worker
//     destroyed), the evidence a cancel has; the outcome wraps ErrStalled
//     and ErrRevoked;
//   - destination: its receives (push) or its gets and their flush (pull)
//     stop as on a cancel; the transfer resolves once every one it posted
//     completed or was withdrawn, with an outcome that wraps ErrStalled.
//     A receive that a message already matched, or a get of a source that
//     stopped, is not withdrawn: the transfer then stays pending (its
//     blocks quarantined) as after a cancel, until late evidence or Close.
//
// The clock measures time since the last progress, on the monotonic
// clock, not the transfer's length: a slow but live peer is never
// stalled.

// DefaultStallTimeout is Config.StallTimeout when zero or negative.
const DefaultStallTimeout = 10 * time.Second

// stallClock is one transfer's progress timeout.
type stallClock struct {
	d    time.Duration
	base time.Time    // the transfer's start (monotonic)
	last atomic.Int64 // the last progress, in nanoseconds since base
	done chan struct{}
	once sync.Once
}

func newStallClock(d time.Duration) *stallClock {
	return &stallClock{d: d, base: time.Now(), done: make(chan struct{})}
}

// progress marks progress now.
func (c *stallClock) progress() { c.last.Store(int64(time.Since(c.base))) }

// idle is the time since the last progress (or the start).
func (c *stallClock) idle() time.Duration {
	return time.Since(c.base) - time.Duration(c.last.Load())
}

// stop ends the watch: the transfer ended. Idempotent.
func (c *stallClock) stop() { c.once.Do(func() { close(c.done) }) }

// watch waits until StallTimeout passed with no progress, then calls
// fire with the time since the last progress, once, and returns; or
// returns when stop is called first. It runs on a goroutine of its own.
func (c *stallClock) watch(fire func(idle time.Duration)) {
	t := time.NewTimer(c.d)
	defer t.Stop()
	for {
		select {
		case <-c.done:
			return
		case <-t.C:
		}
		idle := c.idle()
		if idle >= c.d {
			select {
			case <-c.done:
			default:
				fire(idle)
			}
			return
		}
		t.Reset(c.d - idle)
	}
}
