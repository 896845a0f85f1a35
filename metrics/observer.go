package metrics

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvlease/kvlease"
)

// Observer returns the kvlease.Observer that feeds the duration
// histograms of the pool labelled pool; give it to that pool with
// kvlease.WithObserver (wrap it in a kvlease.ObserverFunc to combine it
// with an observer of your own). Asking twice for one pool returns the
// same Observer. Pools share no lease ids, so give each pool its own.
//
// It times, per lease, a transfer from EventAttached to its
// EventTransferResolved or EventTransferQuarantined; a drain from the
// close (EventReleased, EventAborted) of a lease that still had transfers
// pending to EventSettled; a quarantine from EventLeaseQuarantined to
// EventQuarantineLifted. Other events return at once without a lock. It
// holds one entry per pending transfer, draining lease and quarantined
// lease, each dropped when its interval ends (or the lease settles or
// leaks).
func (c *Collector) Observer(pool string) kvlease.Observer {
	c.mu.Lock()
	defer c.mu.Unlock()
	if o, ok := c.obs[pool]; ok {
		return o
	}
	o := &poolObserver{
		now:        c.now,
		transfer:   c.transfer.WithLabelValues(pool),
		drain:      c.drain.WithLabelValues(pool),
		quarantine: c.quarantine.WithLabelValues(pool),
		attached:   map[attKey]time.Time{},
		leases:     map[uint64]*leaseTimes{},
	}
	c.obs[pool] = o
	return o
}

type attKey struct{ lease, transfer uint64 }

type leaseTimes struct {
	pending     int       // transfers attached and not yet ended
	closed      time.Time // zero unless closed with transfers pending
	quarantined time.Time // zero unless quarantined
}

type poolObserver struct {
	now                         func() time.Time
	transfer, drain, quarantine prometheus.Observer

	mu       sync.Mutex
	attached map[attKey]time.Time
	leases   map[uint64]*leaseTimes
}

// Observe implements kvlease.Observer.
func (o *poolObserver) Observe(e kvlease.Event) {
	switch e.Kind {
	case kvlease.EventAttached, kvlease.EventTransferResolved, kvlease.EventTransferQuarantined,
		kvlease.EventReleased, kvlease.EventAborted, kvlease.EventSettled,
		kvlease.EventLeaseQuarantined, kvlease.EventQuarantineLifted, kvlease.EventLeaked:
	default:
		return
	}
	now := o.now()
	o.mu.Lock()
	defer o.mu.Unlock()
	lt := o.leases[e.Lease]
	switch e.Kind {
	case kvlease.EventAttached:
		k := attKey{e.Lease, e.Transfer}
		if _, ok := o.attached[k]; ok {
			return // a second range of the same transfer: timed from the first
		}
		o.attached[k] = now
		if lt == nil {
			lt = &leaseTimes{}
			o.leases[e.Lease] = lt
		}
		lt.pending++
	case kvlease.EventTransferResolved, kvlease.EventTransferQuarantined:
		k := attKey{e.Lease, e.Transfer}
		start, ok := o.attached[k]
		if !ok {
			return // late evidence for a quarantined transfer: already timed
		}
		delete(o.attached, k)
		o.transfer.Observe(now.Sub(start).Seconds())
		if lt != nil {
			lt.pending--
			o.gc(e.Lease, lt)
		}
	case kvlease.EventReleased, kvlease.EventAborted:
		if lt != nil && lt.pending > 0 {
			lt.closed = now
		}
	case kvlease.EventLeaseQuarantined:
		if lt == nil {
			lt = &leaseTimes{}
			o.leases[e.Lease] = lt
		}
		lt.quarantined = now
	case kvlease.EventQuarantineLifted:
		if lt != nil && !lt.quarantined.IsZero() {
			o.quarantine.Observe(now.Sub(lt.quarantined).Seconds())
			lt.quarantined = time.Time{}
			o.gc(e.Lease, lt)
		}
	case kvlease.EventSettled:
		if lt != nil {
			if !lt.closed.IsZero() {
				o.drain.Observe(now.Sub(lt.closed).Seconds())
			}
			o.forget(e.Lease)
		}
	case kvlease.EventLeaked:
		o.forget(e.Lease)
	}
}

// gc drops the lease's entry once it times nothing.
func (o *poolObserver) gc(id uint64, lt *leaseTimes) {
	if lt.pending <= 0 && lt.closed.IsZero() && lt.quarantined.IsZero() {
		delete(o.leases, id)
	}
}

// forget drops everything kept for the lease.
func (o *poolObserver) forget(id uint64) {
	delete(o.leases, id)
	for k := range o.attached {
		if k.lease == id {
			delete(o.attached, k)
		}
	}
}

// tracked reports how many entries the observer holds (tests).
func (o *poolObserver) tracked() (attached, leases int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.attached), len(o.leases)
}
