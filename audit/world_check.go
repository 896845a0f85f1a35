package audit

// cheapCheck runs after every operation: the state counts sum to
// capacity.
func (w *world) cheapCheck() {
	for _, ps := range w.pools {
		s := ps.p.Stats()
		if sum := s.Free + s.Cached + s.Leased + s.Draining + s.Quarantined; sum != s.Capacity {
			w.violate(CountMismatch, "%s: state counts %+v sum to %d, capacity %d", ps.name, s, sum, s.Capacity)
		}
	}
}

// fullCheck checks every live lease's markers, every pool's internal
// consistency, and the state counts against the model.
func (w *world) fullCheck() {
	for _, ps := range w.pools {
		if err := ps.p.Check(); err != nil {
			w.violate(PoolCheck, "%s: %v", ps.name, err)
		}
		if w.cfg.Concurrent && w.op >= 0 {
			continue // the model is exact only at rest
		}
		s := ps.p.Stats()
		var q, l, d, fc int
		for id := range ps.held {
			switch {
			case ps.quar[id] > 0:
				q++
			case ps.held[id] > 0:
				l++
			case ps.pend[id] > 0:
				d++
			default:
				fc++
			}
		}
		if s.Quarantined != q || s.Leased != l || s.Draining != d || s.Free+s.Cached != fc {
			w.violate(CountMismatch, "%s: pool counts quarantined %d, leased %d, draining %d, free+cached %d; the audit's leases and transfers say %d, %d, %d, %d",
				ps.name, s.Quarantined, s.Leased, s.Draining, s.Free+s.Cached, q, l, d, fc)
		}
	}
	for _, r := range w.live {
		w.checkLease(r.cur)
	}
}
