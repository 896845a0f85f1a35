package kvlease

import (
	"fmt"
	"time"
)

// startDeadline arms the drain deadline for a lease that closed unsettled.
func (c *core) startDeadline(l *lease) {
	if c.cfg.deadline <= 0 {
		return
	}
	l.ext().timer = time.AfterFunc(c.cfg.deadline, func() { c.deadlinePassed(l) })
}

// deadlinePassed quarantines the still-pending transfers of a lease that
// did not settle in time, reports it, and then asks each transfer's
// transport to stop (Cancel): quarantine alone would wait for evidence
// from a transport nobody asked to return. Nothing is freed here.
func (c *core) deadlinePassed(l *lease) {
	var ev outbox
	var ts []*Transfer
	c.mu.Lock()
	if l.current() == LeaseSettled {
		c.unlock()
		return
	}
	for i := range l.natts {
		if a := l.att(i); a.applied == TransferPending {
			ts = append(ts, a.t)
		}
	}
	if c.obs != nil {
		ev.add(c.obs, Event{Kind: EventDeadline, Owner: l.owner, Lease: l.id, Blocks: len(l.blocks),
			Err: ErrDrainDeadline})
	}
	c.unlock()
	ev.flush()
	for _, t := range ts {
		t.Quarantine(fmt.Errorf("kvlease: lease %d (%s) not settled after %v: %w", l.id, l.owner, c.cfg.deadline, ErrDrainDeadline))
		t.Cancel()
	}
}
