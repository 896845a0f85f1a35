package kvlease_test

import (
	"errors"
	"sync"
	"testing"

	"github.com/kvlease/kvlease"
)

// corePanics fails unless f panics.
func corePanics(t *testing.T, what string, f func()) {
	t.Helper()
	defer func() {
		if recover() == nil {
			t.Fatalf("%s did not panic", what)
		}
	}()
	f()
}

func TestLeaseAccessors(t *testing.T) {
	p := corePool(t, 8)
	l := coreAcquire(t, p, "req-1", 3)
	if l.Owner() != "req-1" || l.Len() != 3 || l.State() != kvlease.LeaseActive {
		t.Fatalf("owner %q len %d state %v", l.Owner(), l.Len(), l.State())
	}
	refs := []kvlease.BlockRef{l.Ref(0), l.Ref(1), l.Ref(2)}
	for i := range 3 {
		r, err := l.Region(i)
		coreNoErr(t, err, "Region")
		if len(r) != 64 || cap(r) != 64 {
			t.Fatalf("Region(%d): len %d cap %d, want 64", i, len(r), cap(r))
		}
	}
	for _, i := range []int{-1, 3, 100} {
		_, err := l.Region(i)
		coreErrIs(t, err, kvlease.ErrInvalidArgument, "Region out of range")
		corePanics(t, "Ref out of range", func() { l.Ref(i) })
	}

	// AppendBlockIDs: the tail from `from`, no allocation with room.
	ids := l.AppendBlockIDs(nil, 0)
	if len(ids) != 3 || ids[0] != refs[0].ID || ids[2] != refs[2].ID {
		t.Fatalf("AppendBlockIDs = %v, refs %v", ids, refs)
	}
	dst := []kvlease.BlockID{99}
	if got := l.AppendBlockIDs(dst, 2); len(got) != 2 || got[0] != 99 || got[1] != refs[2].ID {
		t.Fatalf("AppendBlockIDs(dst, 2) = %v", got)
	}
	if got := l.AppendBlockIDs(dst, 3); len(got) != 1 {
		t.Fatalf("AppendBlockIDs(dst, Len) = %v, want dst unchanged", got)
	}
	for _, from := range []int{-1, 4} {
		corePanics(t, "AppendBlockIDs out of range", func() { l.AppendBlockIDs(nil, from) })
	}
	buf := make([]kvlease.BlockID, 0, 8)
	if n := testing.AllocsPerRun(100, func() { buf = l.AppendBlockIDs(buf[:0], 0) }); n != 0 {
		t.Fatalf("AppendBlockIDs with room allocates %v times", n)
	}

	l.Release()
	// Refs and Len still answer after close; Region does not.
	if l.Len() != 3 {
		t.Fatalf("Len after Release = %d", l.Len())
	}
	for i, r := range refs {
		if l.Ref(i) != r {
			t.Fatalf("Ref(%d) changed after Release", i)
		}
		_, err := p.Region(r)
		coreErrIs(t, err, kvlease.ErrStaleRef, "Pool.Region of a released block")
	}
	_, err := l.Region(0)
	coreErrIs(t, err, kvlease.ErrLeaseClosed, "Region after Release")
	_, err = l.Region(-1)
	if !errors.Is(err, kvlease.ErrLeaseClosed) && !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("Region(-1) after Release: %v", err)
	}
	coreAllFree(t, p)
}

// Release and Abort are idempotent, in every combination.
func TestReleaseAbortIdempotent(t *testing.T) {
	for _, seq := range [][]string{
		{"release", "release"},
		{"release", "abort"},
		{"abort", "abort"},
		{"abort", "release"},
	} {
		t.Run(seq[0]+"-"+seq[1], func(t *testing.T) {
			rec := &coreRecorder{}
			p := corePool(t, 4, kvlease.WithObserver(rec))
			l := coreAcquire(t, p, "a", 2)
			hooks := 0
			tr := kvlease.NewTransfer(func() { hooks++ })
			coreNoErr(t, l.AttachRange(tr, 0, 1, kvlease.Write), "AttachRange")
			for _, op := range seq {
				if op == "release" {
					l.Release()
				} else {
					l.Abort(nil)
				}
				coreWant(t, p, coreCounts{Free: 3, Draining: 1})
				if l.State() != kvlease.LeaseDraining {
					t.Fatalf("after %s: %v", op, l.State())
				}
			}
			wantHooks := 0
			if seq[0] == "abort" {
				wantHooks = 1
			}
			if hooks != wantHooks {
				t.Fatalf("cancel hook ran %d times, want %d", hooks, wantHooks)
			}
			if n := rec.count(kvlease.EventReleased, l.ID()) + rec.count(kvlease.EventAborted, l.ID()); n != 1 {
				t.Fatalf("%d close events, want 1", n)
			}
			if st := p.Stats(); st.OpenLeases != 0 {
				t.Fatalf("OpenLeases = %d", st.OpenLeases)
			}
			tr.Resolve(nil)
			l.Release()
			l.Abort(errors.New("again"))
			if n := rec.count(kvlease.EventSettled, l.ID()); n != 1 {
				t.Fatalf("%d settled events, want 1", n)
			}
			coreAllFree(t, p)
		})
	}
}

func TestAbortCause(t *testing.T) {
	rec := &coreRecorder{}
	p := corePool(t, 2, kvlease.WithObserver(rec))
	l := coreAcquire(t, p, "a", 1)
	l.Abort(nil)
	ev, ok := rec.last(kvlease.EventAborted)
	if !ok || !errors.Is(ev.Err, kvlease.ErrAborted) || ev.Lease != l.ID() || ev.Owner != "a" {
		t.Fatalf("Abort(nil) event %+v", ev)
	}
	cause := errors.New("client went away")
	m := coreAcquire(t, p, "b", 1)
	m.Abort(cause)
	ev, _ = rec.last(kvlease.EventAborted)
	if !errors.Is(ev.Err, cause) {
		t.Fatalf("Abort(cause) event %+v", ev)
	}
	coreAllFree(t, p)
}

func TestExtend(t *testing.T) {
	rec := &coreRecorder{}
	p := corePool(t, 6, kvlease.WithObserver(rec))
	l := coreAcquire(t, p, "a", 2)
	other := coreAcquire(t, p, "b", 2)

	for _, n := range []int{0, -1, -100} {
		coreErrIs(t, l.Extend(n), kvlease.ErrInvalidArgument, "Extend(<=0)")
	}
	coreErrIs(t, l.Extend(5), kvlease.ErrExceedsCapacity, "Extend past the pool's capacity")
	coreErrIs(t, l.Extend(3), kvlease.ErrExhausted, "Extend with 2 free")
	if l.Len() != 2 {
		t.Fatalf("failed Extends changed Len to %d", l.Len())
	}
	coreWant(t, p, coreCounts{Free: 2, Leased: 4})

	old := l.Ref(1)
	coreNoErr(t, l.Extend(2), "Extend(2)")
	if l.Len() != 4 || l.Ref(1) != old {
		t.Fatalf("Extend: len %d, ref 1 %v (was %v)", l.Len(), l.Ref(1), old)
	}
	if ev, ok := rec.last(kvlease.EventExtended); !ok || ev.Blocks != 2 || ev.Lease != l.ID() {
		t.Fatalf("EventExtended %+v", ev)
	}
	coreWant(t, p, coreCounts{Leased: 6})
	seen := map[kvlease.BlockID]bool{}
	for _, ls := range []*kvlease.Lease[[]byte]{l, other} {
		for i := 0; i < ls.Len(); i++ {
			r := ls.Ref(i)
			if seen[r.ID] || r.Gen == 0 {
				t.Fatalf("block %v handed out twice", r)
			}
			seen[r.ID] = true
			_, err := p.Region(r)
			coreNoErr(t, err, "Pool.Region of an extended block")
		}
	}
	for i := 2; i < 4; i++ {
		_, err := l.Region(i)
		coreNoErr(t, err, "Lease.Region of an extended block")
	}
	coreErrIs(t, l.Extend(1), kvlease.ErrExhausted, "Extend on a full pool")

	other.Release()
	l.Release()
	coreErrIs(t, l.Extend(1), kvlease.ErrLeaseClosed, "Extend after Release")
	m := coreAcquire(t, p, "m", 1)
	m.Abort(nil)
	coreErrIs(t, m.Extend(1), kvlease.ErrLeaseClosed, "Extend after Abort")
	coreAllFree(t, p)

	// Extend evicts cached blocks when nothing is free.
	a := coreAcquire(t, p, "a", 3)
	for i := range 3 {
		coreNoErr(t, a.Seal(i, kvlease.BlockHash(10+i)), "Seal")
	}
	a.Release()
	g := coreAcquire(t, p, "g", 3)
	coreWant(t, p, coreCounts{Cached: 3, Leased: 3})
	coreNoErr(t, g.Extend(2), "Extend over cached blocks")
	coreWant(t, p, coreCounts{Cached: 1, Leased: 5})
	g.Release()
	coreAllFree(t, p)
}

// Attach gates every block, including blocks Extend adds later: as a
// Write on unsealed blocks and a Read on sealed ones.
func TestAttachGatesExtendedBlocks(t *testing.T) {
	p := corePool(t, 8)
	a := coreAcquire(t, p, "a", 2)
	coreNoErr(t, a.Seal(0, 1), "Seal")
	a.Release() // block with hash 1 is cached now
	l, hits, err := p.AcquirePrefix("l", []kvlease.BlockHash{1}, 2)
	coreNoErr(t, err, "AcquirePrefix")
	if hits != 1 {
		t.Fatalf("hits = %d", hits)
	}
	tr := kvlease.NewTransfer(nil)
	coreNoErr(t, l.Attach(tr), "Attach")
	// Read on the sealed hit: it keeps serving hits.
	if n := p.CachedPrefix([]kvlease.BlockHash{1}); n != 1 {
		t.Fatalf("CachedPrefix of a block read by a pending transfer = %d, want 1", n)
	}
	// Write on the unsealed block: no Seal while the transfer writes it.
	coreErrIs(t, l.Seal(1, 2), kvlease.ErrInvalidArgument, "Seal of a block under a pending whole Attach")

	coreNoErr(t, l.Extend(3), "Extend")
	for i := 2; i < 5; i++ {
		coreErrIs(t, l.Seal(i, kvlease.BlockHash(100+i)), kvlease.ErrInvalidArgument, "Seal of an extended block under Attach")
	}
	l.Release()
	coreWant(t, p, coreCounts{Free: 3, Draining: 5})
	if l.State() != kvlease.LeaseDraining {
		t.Fatalf("state %v", l.State())
	}
	select {
	case <-l.Settled():
		t.Fatal("settled while a transfer gates every block")
	default:
	}
	tr.Resolve(nil)
	<-l.Settled()
	coreWant(t, p, coreCounts{Free: 7, Cached: 1})

	// Quarantine reaches extended blocks too.
	m := coreAcquire(t, p, "m", 1)
	q := kvlease.NewTransfer(nil)
	coreNoErr(t, m.Attach(q), "Attach")
	q.Quarantine(nil)
	coreNoErr(t, m.Extend(2), "Extend while quarantined")
	if m.State() != kvlease.LeaseQuarantined {
		t.Fatalf("state %v", m.State())
	}
	coreWant(t, p, coreCounts{Free: 4, Cached: 1, Quarantined: 3})
	m.Release()
	coreWant(t, p, coreCounts{Free: 4, Cached: 1, Quarantined: 3})
	q.Resolve(nil)
	coreAllFree(t, p)
}

// AttachRange ranges are fixed: blocks Extend adds are not in them.
func TestAttachRangeFixed(t *testing.T) {
	p := corePool(t, 8)
	l := coreAcquire(t, p, "l", 2)
	tr := kvlease.NewTransfer(nil)
	coreNoErr(t, l.AttachRange(tr, 0, 2, kvlease.Write), "AttachRange")
	coreNoErr(t, l.Extend(2), "Extend")
	coreNoErr(t, l.Seal(2, 9), "Seal of an extended block outside the range")
	coreErrIs(t, l.Seal(1, 8), kvlease.ErrInvalidArgument, "Seal of a block under a pending write")
	l.Release()
	coreWant(t, p, coreCounts{Free: 5, Cached: 1, Draining: 2})
	tr.Resolve(nil)
	coreWant(t, p, coreCounts{Free: 7, Cached: 1})
}

func TestAttachMisuse(t *testing.T) {
	p := corePool(t, 4)
	l := coreAcquire(t, p, "l", 3)
	coreNoErr(t, l.Seal(2, 77), "Seal")
	tr := kvlease.NewTransfer(nil)
	for _, c := range []struct {
		from, to int
		a        kvlease.Access
	}{
		{-1, 1, kvlease.Read}, {0, 4, kvlease.Read}, {2, 1, kvlease.Write}, {4, 4, kvlease.Read},
		{-1, -1, kvlease.Write}, {0, 1, 0}, {0, 1, 99},
		{0, 3, kvlease.Write}, {2, 3, kvlease.Write}, // Write over a sealed block
	} {
		coreErrIs(t, l.AttachRange(tr, c.from, c.to, c.a), kvlease.ErrInvalidArgument, "bad AttachRange")
	}
	coreErrIs(t, l.AttachRange(nil, 0, 1, kvlease.Read), kvlease.ErrInvalidArgument, "AttachRange(nil)")
	coreErrIs(t, l.Attach(nil), kvlease.ErrInvalidArgument, "Attach(nil)")
	// Nothing was attached: the lease settles at once.
	coreWant(t, p, coreCounts{Free: 1, Leased: 3})
	l.Release()
	if l.State() != kvlease.LeaseSettled {
		t.Fatalf("refused attachments gate the lease: %v", l.State())
	}
	coreWant(t, p, coreCounts{Free: 3, Cached: 1})
	if tr.State() != kvlease.TransferPending {
		t.Fatalf("transfer %v", tr.State())
	}
	// Attach after close.
	coreErrIs(t, l.Attach(tr), kvlease.ErrLeaseClosed, "Attach after Release")
	coreErrIs(t, l.AttachRange(tr, 0, 1, kvlease.Read), kvlease.ErrLeaseClosed, "AttachRange after Release")
	m := coreAcquire(t, p, "m", 1)
	m.Abort(nil)
	coreErrIs(t, m.Attach(tr), kvlease.ErrLeaseClosed, "Attach after Abort")
	coreErrIs(t, m.AttachRange(tr, 0, 1, kvlease.Write), kvlease.ErrLeaseClosed, "AttachRange after Abort")
	coreAllFree(t, p)
	tr.Resolve(nil)
	coreAllFree(t, p)
}

// An empty range, and an already resolved transfer, gate nothing.
func TestAttachGatesNothing(t *testing.T) {
	p := corePool(t, 4)
	l := coreAcquire(t, p, "l", 2)
	pending := kvlease.NewTransfer(nil)
	coreNoErr(t, l.AttachRange(pending, 1, 1, kvlease.Write), "empty range")
	coreNoErr(t, l.AttachRange(pending, 0, 0, kvlease.Read), "empty range at 0")
	coreNoErr(t, l.AttachRange(pending, 2, 2, kvlease.Write), "empty range at Len")
	done := kvlease.NewTransfer(nil)
	done.Resolve(nil)
	coreNoErr(t, l.Attach(done), "Attach of a resolved transfer")
	coreNoErr(t, l.AttachRange(done, 0, 2, kvlease.Write), "AttachRange of a resolved transfer")
	coreNoErr(t, l.Seal(0, 5), "Seal: nothing is writing")
	l.Release()
	if l.State() != kvlease.LeaseSettled {
		t.Fatalf("state %v: something gates the lease", l.State())
	}
	<-l.Settled()
	coreWant(t, p, coreCounts{Free: 3, Cached: 1})
	pending.Resolve(nil)
}

// Seal refuses a block with a pending or quarantined write, and a re-seal
// with a different hash; a pending read is fine.
func TestSealUnderTransfers(t *testing.T) {
	p := corePool(t, 4)
	l := coreAcquire(t, p, "l", 3)
	w := kvlease.NewTransfer(nil)
	r := kvlease.NewTransfer(nil)
	coreNoErr(t, l.AttachRange(w, 0, 1, kvlease.Write), "write")
	coreNoErr(t, l.AttachRange(r, 1, 2, kvlease.Read), "read")
	coreErrIs(t, l.Seal(0, 1), kvlease.ErrInvalidArgument, "Seal with a pending write")
	coreNoErr(t, l.Seal(1, 2), "Seal with a pending read")
	coreNoErr(t, l.Seal(1, 2), "Seal again with the same hash")
	coreErrIs(t, l.Seal(1, 3), kvlease.ErrInvalidArgument, "re-Seal with another hash")
	for _, i := range []int{-1, 3} {
		coreErrIs(t, l.Seal(i, 4), kvlease.ErrInvalidArgument, "Seal out of range")
	}
	w.Quarantine(nil)
	coreErrIs(t, l.Seal(0, 1), kvlease.ErrInvalidArgument, "Seal with a quarantined write")
	w.Resolve(nil)
	coreNoErr(t, l.Seal(0, 1), "Seal once the write resolved")
	r.Resolve(nil)
	l.Release()
	coreErrIs(t, l.Seal(2, 9), kvlease.ErrLeaseClosed, "Seal after Release")
	coreWant(t, p, coreCounts{Free: 2, Cached: 2})
}

func TestSettledChannel(t *testing.T) {
	p := corePool(t, 4)
	l := coreAcquire(t, p, "l", 2)
	early := l.Settled()
	tr := kvlease.NewTransfer(nil)
	coreNoErr(t, l.AttachRange(tr, 0, 1, kvlease.Read), "AttachRange")
	l.Release()
	select {
	case <-early:
		t.Fatal("Settled closed while a transfer is pending")
	case <-l.Settled():
		t.Fatal("Settled closed while a transfer is pending")
	default:
	}
	tr.Resolve(nil)
	select {
	case <-early:
	default:
		t.Fatal("Settled not closed when Resolve returned")
	}
	<-l.Settled()
	if l.State() != kvlease.LeaseSettled {
		t.Fatalf("state %v", l.State())
	}
	// Settled with nothing attached: at once.
	m := coreAcquire(t, p, "m", 1)
	m.Release()
	<-m.Settled()
	// An open lease never settles.
	n := coreAcquire(t, p, "n", 1)
	select {
	case <-n.Settled():
		t.Fatal("open lease settled")
	default:
	}
	n.Release()
	coreAllFree(t, p)
}

// Abort calls Cancel on every attached transfer that is not resolved
// (pending or quarantined), and not on resolved ones; Release cancels
// nothing.
func TestAbortCancelsUnresolved(t *testing.T) {
	p := corePool(t, 8)
	l := coreAcquire(t, p, "l", 4)
	var mu sync.Mutex
	calls := map[string]int{}
	hook := func(name string) func() {
		return func() { mu.Lock(); calls[name]++; mu.Unlock() }
	}
	pending := kvlease.NewTransfer(hook("pending"))
	quar := kvlease.NewTransfer(hook("quarantined"))
	done := kvlease.NewTransfer(hook("resolved"))
	twice := kvlease.NewTransfer(hook("twice"))
	var self *kvlease.Transfer
	self = kvlease.NewTransfer(func() { // resolves synchronously from its hook
		hook("self")()
		self.Resolve(nil)
	})
	coreNoErr(t, l.AttachRange(pending, 0, 1, kvlease.Write), "attach pending")
	coreNoErr(t, l.AttachRange(quar, 1, 2, kvlease.Write), "attach quarantined")
	coreNoErr(t, l.AttachRange(done, 2, 3, kvlease.Read), "attach resolved")
	coreNoErr(t, l.AttachRange(twice, 0, 2, kvlease.Read), "attach twice (1)")
	coreNoErr(t, l.AttachRange(twice, 2, 4, kvlease.Read), "attach twice (2)")
	coreNoErr(t, l.Attach(self), "attach self-resolving")
	quar.Quarantine(nil)
	done.Resolve(nil)

	l.Abort(nil)
	mu.Lock()
	want := map[string]int{"pending": 1, "quarantined": 1, "twice": 1, "self": 1}
	for k, v := range want {
		if calls[k] != v {
			t.Errorf("cancel hook %q ran %d times, want %d", k, calls[k], v)
		}
	}
	if calls["resolved"] != 0 {
		t.Errorf("cancel hook of a resolved transfer ran")
	}
	mu.Unlock()
	if self.State() != kvlease.TransferResolved {
		t.Fatalf("self-resolving hook: %v", self.State())
	}
	// Cancel is a request, not evidence: nothing else resolved.
	if pending.State() != kvlease.TransferPending || quar.State() != kvlease.TransferQuarantined || twice.State() != kvlease.TransferPending {
		t.Fatal("Abort changed transfer states")
	}
	if l.State() != kvlease.LeaseQuarantined {
		t.Fatalf("state %v", l.State())
	}
	coreWant(t, p, coreCounts{Free: 4, Quarantined: 1, Draining: 3})
	quar.Resolve(nil)
	if l.State() != kvlease.LeaseDraining {
		t.Fatalf("state %v after lifting the quarantine", l.State())
	}
	pending.Resolve(nil)
	twice.Resolve(nil)
	<-l.Settled()
	coreAllFree(t, p)
	// Cancel after resolve runs nothing.
	pending.Cancel()
	mu.Lock()
	if calls["pending"] != 1 {
		t.Fatalf("hook ran after Resolve")
	}
	mu.Unlock()
}

// An Abort (or Release) racing Extend and AttachRange: the loser gets
// ErrLeaseClosed, and whatever was attached before the close is
// cancelled and gates the blocks.
func TestCloseRacesExtendAndAttach(t *testing.T) {
	for round := range 50 {
		p := corePool(t, 64)
		l := coreAcquire(t, p, "l", 1)
		abort := round%2 == 0
		var wg sync.WaitGroup
		var extendErr error
		var attached []*kvlease.Transfer
		var cancelled sync.Map
		start := make(chan struct{})
		wg.Add(3)
		go func() {
			defer wg.Done()
			<-start
			for {
				if extendErr = l.Extend(1); extendErr != nil {
					return
				}
			}
		}()
		go func() {
			defer wg.Done()
			<-start
			for i := 0; i < 1000; i++ {
				var tr *kvlease.Transfer
				tr = kvlease.NewTransfer(func() { cancelled.Store(tr, true) })
				if err := l.AttachRange(tr, 0, 1, kvlease.Read); err != nil {
					if !errors.Is(err, kvlease.ErrLeaseClosed) {
						t.Errorf("AttachRange racing close: %v", err)
					}
					return
				}
				attached = append(attached, tr)
			}
		}()
		go func() {
			defer wg.Done()
			<-start
			if abort {
				l.Abort(nil)
			} else {
				l.Release()
			}
		}()
		close(start)
		wg.Wait()
		if !errors.Is(extendErr, kvlease.ErrLeaseClosed) && !errors.Is(extendErr, kvlease.ErrExhausted) &&
			!errors.Is(extendErr, kvlease.ErrExceedsCapacity) {
			t.Fatalf("Extend racing close: %v", extendErr)
		}
		coreConsistent(t, p)
		for _, tr := range attached {
			if _, ok := cancelled.Load(tr); ok != abort {
				t.Fatalf("transfer attached before the close: cancelled=%v, abort=%v", ok, abort)
			}
		}
		if len(attached) > 0 {
			if l.State() != kvlease.LeaseDraining {
				t.Fatalf("state %v with %d transfers attached", l.State(), len(attached))
			}
			if st := p.Stats(); st.Draining != 1 {
				t.Fatalf("Draining = %d, want the gated block", st.Draining)
			}
		}
		for _, tr := range attached {
			tr.Resolve(nil)
		}
		<-l.Settled()
		coreAllFree(t, p)
	}
}

// A Write over a sealed block is refused whatever the transfer's state:
// DESIGN.md says so without exception, and the range and access checks
// already come before the "resolved gates nothing" rule.
func TestAttachResolvedWriteOverSealed(t *testing.T) {
	p := corePool(t, 2)
	l := coreAcquire(t, p, "l", 1)
	coreNoErr(t, l.Seal(0, 1), "Seal")
	done := kvlease.NewTransfer(nil)
	done.Resolve(nil)
	coreErrIs(t, l.AttachRange(done, 0, 1, kvlease.Write), kvlease.ErrInvalidArgument,
		"AttachRange(resolved transfer, Write) over a sealed block")
	q := kvlease.NewTransfer(nil)
	q.Quarantine(nil)
	coreErrIs(t, l.AttachRange(q, 0, 1, kvlease.Write), kvlease.ErrInvalidArgument,
		"AttachRange(quarantined transfer, Write) over a sealed block")
	l.Release()
	q.Resolve(nil)
	coreAllFree(t, p)
}
