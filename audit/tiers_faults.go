package audit

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/tiers"

	"go.uber.org/atomic"
)

var (
	errInjectedCopy = errors.New("audit: injected copy failure")
	errInjectedDisk = errors.New("audit: injected disk failure")
	errInjectedQuar = errors.New("audit: injected quarantine (device lost)")
	errLateFailed   = errors.New("audit: late evidence: the quarantined copy never finished")
	errStallCancel  = errors.New("audit: stalled copy canceled")
)

// copier is the audit's device↔host transport: a plain copy on a
// goroutine of its own, or one of the injected faults.
type copier struct{ r *tiersRun[[]byte] }

func (c copier) Start(pairs []kvlease.CopyPair[[]byte, []byte], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	if len(pairs) == 0 || attach == nil {
		return nil, fmt.Errorf("audit: copy of %d pairs: %w", len(pairs), kvlease.ErrInvalidArgument)
	}
	r := c.r
	f := r.cfg.Faults
	var canceled atomic.Bool
	t := kvlease.NewTransfer(func() { canceled.Store(true) })
	if err := attach(t); err != nil {
		t.Resolve(err)
		return t, err
	}
	copyAll := func() bool {
		for _, p := range pairs {
			if canceled.Load() {
				return false
			}
			copy(p.Dst, p.Src)
		}
		return true
	}
	switch {
	case r.chance(f.CopyFail):
		r.count(&r.rep.CopyFails)
		go func() {
			half := len(pairs) / 2
			for i, p := range pairs {
				if i < half {
					copy(p.Dst, p.Src)
				} else {
					junk(p.Dst)
				}
			}
			if r.cfg.lieOnFail {
				t.Resolve(nil)
				return
			}
			t.Resolve(errInjectedCopy)
		}()
	case r.chance(f.Stall):
		r.count(&r.rep.Stalls)
		r.hold(func() {
			if copyAll() {
				t.Resolve(nil)
			} else {
				t.Resolve(errStallCancel)
			}
		})
	case r.chance(f.Quarantine):
		r.count(&r.rep.Quarantines)
		for _, p := range pairs {
			junk(p.Dst)
		}
		t.Quarantine(errInjectedQuar)
		finish := r.chance(0.5)
		r.hold(func() {
			if finish && copyAll() {
				t.Resolve(nil)
			} else {
				t.Resolve(errLateFailed)
			}
		})
	default:
		go func() {
			if copyAll() {
				t.Resolve(nil)
			} else {
				t.Resolve(errStallCancel)
			}
		}()
	}
	return t, nil
}

// beforeIO is the disk tier's fault hook.
func (r *tiersRun[D]) beforeIO(write bool, slot tiers.DiskSlot) error {
	f := r.cfg.Faults
	switch {
	case r.chance(f.DiskFail):
		r.count(&r.rep.DiskFails)
		return fmt.Errorf("slot %d (write %v): %w", slot, write, errInjectedDisk)
	case r.chance(f.Stall):
		r.count(&r.rep.Stalls)
		ch := make(chan struct{})
		r.hold(func() { close(ch) })
		<-ch
	}
	return nil
}

// corrupt overwrites a few bytes of a slot file at rest.
func (r *tiersRun[D]) corrupt() error {
	entries, err := os.ReadDir(r.dir)
	if err != nil {
		return err
	}
	var files []string
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".slots") {
			files = append(files, filepath.Join(r.dir, e.Name()))
		}
	}
	if len(files) == 0 {
		return nil
	}
	f, err := os.OpenFile(files[r.intN(len(files))], os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if fi.Size() < 16 {
		return nil
	}
	b := make([]byte, 8)
	for i := range b {
		b[i] = byte(r.intN(256))
	}
	if _, err := f.WriteAt(b, int64(r.intN(int(fi.Size()-8)))); err != nil {
		return err
	}
	r.count(&r.rep.Corruptions)
	return nil
}

// faultyTransport is the cache's device↔host transport as the audit
// hands it over: it alternates between two transports (when both are
// set) and cancels a share of the copies right after they start.
type faultyTransport[S, D any] struct {
	next [2]kvlease.Transport[S, D]
	n    *atomic.Uint64
	// after runs on every transfer started.
	after func(*kvlease.Transfer)
}

func (f faultyTransport[S, D]) Start(pairs []kvlease.CopyPair[S, D], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	next := f.next[0]
	if f.next[1] != nil && f.n.Add(1)%2 == 0 {
		next = f.next[1]
	}
	t, err := next.Start(pairs, attach)
	if err == nil && t != nil {
		f.after(t)
	}
	return t, err
}

// cancelSome is the Cancel fault: a copy canceled as soon as it started.
func (r *tiersRun[D]) cancelSome(t *kvlease.Transfer) {
	if r.chance(r.cfg.Faults.Cancel) {
		r.count(&r.rep.Cancels)
		t.Cancel()
	}
}
