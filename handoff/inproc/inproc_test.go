package inproc_test

import (
	"errors"
	"fmt"
	"reflect"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/inproc"
)

const blockBytes = 32

// rig is a source lease of n marked blocks and a destination lease of n
// blocks, with pairs between them.
type rig struct {
	src, dst   *kvlease.Pool[[]byte]
	from, to   *kvlease.Lease[[]byte]
	pairs      []kvlease.CopyPair[[]byte, []byte]
	attachBoth func(*kvlease.Transfer) error
}

func newRig(t *testing.T, n int) *rig {
	t.Helper()
	r := &rig{}
	for _, p := range []**kvlease.Pool[[]byte]{&r.src, &r.dst} {
		mem, err := kvlease.NewHostMemory(16, blockBytes)
		if err != nil {
			t.Fatal(err)
		}
		if *p, err = kvlease.NewPool[[]byte](mem); err != nil {
			t.Fatal(err)
		}
	}
	r.from, _ = r.src.Acquire("req", n)
	r.to, _ = r.dst.Acquire("req", n)
	for i := range n {
		s, _ := r.from.Region(i)
		d, _ := r.to.Region(i)
		for j := range s {
			s[j] = byte(i + 1)
		}
		r.pairs = append(r.pairs, kvlease.CopyPair[[]byte, []byte]{Src: s, Dst: d})
	}
	r.attachBoth = func(tr *kvlease.Transfer) error {
		if err := r.from.AttachRange(tr, 0, n, kvlease.Read); err != nil {
			return err
		}
		return r.to.AttachRange(tr, 0, n, kvlease.Write)
	}
	return r
}

// copied returns, per destination block, whether it holds its marker.
func (r *rig) copied() []bool {
	var out []bool
	for _, p := range r.pairs {
		out = append(out, p.Dst[0] == p.Src[0] && p.Dst[blockBytes-1] == p.Src[0])
	}
	return out
}

func fixed(p inproc.Plan) func(uint64, int) inproc.Plan {
	return func(uint64, int) inproc.Plan { return p }
}

func mustNew(t *testing.T, cfg inproc.Config) *inproc.Transport {
	t.Helper()
	tp, err := inproc.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return tp
}

func TestComplete(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newRig(t, 3)
		var written atomic.Int32
		tp := mustNew(t, inproc.Config{
			Decide:     fixed(inproc.Plan{Latency: time.Second, HonourCancel: true}),
			AfterWrite: func(inproc.Write) { written.Add(1) },
		})
		tr, err := tp.Start(r.pairs, r.attachBoth)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(2500 * time.Millisecond)
		synctest.Wait()
		if tr.State() != kvlease.TransferPending || written.Load() != 2 {
			t.Fatalf("after 2.5s: %v, %d blocks written", tr.State(), written.Load())
		}
		tp.Wait()
		if tr.State() != kvlease.TransferResolved || tr.Err() != nil {
			t.Fatalf("transfer %v, %v", tr.State(), tr.Err())
		}
		if !reflect.DeepEqual(r.copied(), []bool{true, true, true}) {
			t.Fatalf("copied %v", r.copied())
		}
		if got := tp.Stats(); got != (inproc.Stats{Started: 1, Completed: 1}) {
			t.Fatalf("stats %+v", got)
		}
	})
}

func TestFail(t *testing.T) {
	r := newRig(t, 4)
	tp := mustNew(t, inproc.Config{Decide: fixed(inproc.Plan{Fate: inproc.FateFail, FailAt: 2})})
	tr, err := tp.Start(r.pairs, r.attachBoth)
	if err != nil {
		t.Fatal(err)
	}
	<-tr.Done()
	if !errors.Is(tr.Err(), inproc.ErrInjected) {
		t.Fatalf("outcome %v", tr.Err())
	}
	if !reflect.DeepEqual(r.copied(), []bool{true, true, false, false}) {
		t.Fatalf("copied %v", r.copied())
	}
	tp.Wait()
	if got := tp.Stats(); got != (inproc.Stats{Started: 1, Failed: 1}) {
		t.Fatalf("stats %+v", got)
	}
}

// TestLostAck: the copy finishes, the transfer is never resolved, so its
// blocks stay held; Acknowledge is the late evidence.
func TestLostAck(t *testing.T) {
	r := newRig(t, 2)
	tp := mustNew(t, inproc.Config{Decide: fixed(inproc.Plan{Fate: inproc.FateLoseAck})})
	tr, err := tp.Start(r.pairs, r.attachBoth)
	if err != nil {
		t.Fatal(err)
	}
	tp.Wait()
	if tr.State() != kvlease.TransferPending || !reflect.DeepEqual(r.copied(), []bool{true, true}) {
		t.Fatalf("transfer %v, copied %v", tr.State(), r.copied())
	}
	if lost := tp.Lost(); len(lost) != 1 || lost[0] != tr {
		t.Fatalf("lost %v", lost)
	}
	r.to.Abort(nil)
	tr.Quarantine(errors.New("no ack"))
	if q := r.dst.Stats().Quarantined; q != 2 {
		t.Fatalf("quarantined %d", q)
	}
	if !tp.Acknowledge(tr) || tp.Acknowledge(tr) {
		t.Fatal("Acknowledge must deliver once")
	}
	if tr.State() != kvlease.TransferResolved || tr.Err() != nil || len(tp.Lost()) != 0 {
		t.Fatalf("after the late ack: %v %v %v", tr.State(), tr.Err(), tp.Lost())
	}
	if s := r.dst.Stats(); s.Free != 16 {
		t.Fatalf("destination %+v", s)
	}
	if got := tp.Stats(); got != (inproc.Stats{Started: 1, Lost: 1, Acknowledged: 1, CancelsIgnored: 1}) {
		t.Fatalf("stats %+v", got)
	}
	if tp.Acknowledge(kvlease.NewTransfer(nil)) {
		t.Fatal("acknowledged a stranger")
	}
}

func TestCancel(t *testing.T) {
	for _, honour := range []bool{true, false} {
		t.Run(fmt.Sprint("honour=", honour), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				r := newRig(t, 4)
				tp := mustNew(t, inproc.Config{Decide: fixed(inproc.Plan{Latency: time.Second, HonourCancel: honour})})
				tr, err := tp.Start(r.pairs, r.attachBoth)
				if err != nil {
					t.Fatal(err)
				}
				time.Sleep(1500 * time.Millisecond) // block 0 written, block 1 waiting
				r.to.Abort(nil)                     // cancels the transfer
				synctest.Wait()
				if honour {
					if !errors.Is(tr.Err(), kvlease.ErrCanceled) || !reflect.DeepEqual(r.copied(), []bool{true, false, false, false}) {
						t.Fatalf("outcome %v, copied %v", tr.Err(), r.copied())
					}
					if got := tp.Stats(); got != (inproc.Stats{Started: 1, Canceled: 1}) {
						t.Fatalf("stats %+v", got)
					}
				} else {
					if tr.State() != kvlease.TransferPending {
						t.Fatal("an ignored cancel resolved the transfer")
					}
					if s := r.dst.Stats(); s.Draining != 4 {
						t.Fatalf("aborted destination not draining: %+v", s)
					}
					tp.Wait()
					if tr.Err() != nil || !reflect.DeepEqual(r.copied(), []bool{true, true, true, true}) {
						t.Fatalf("outcome %v, copied %v", tr.Err(), r.copied())
					}
					if got := tp.Stats(); got != (inproc.Stats{Started: 1, Completed: 1, CancelsIgnored: 1}) {
						t.Fatalf("stats %+v", got)
					}
				}
				if s := r.dst.Stats(); s.Free != 16 {
					t.Fatalf("destination %+v", s)
				}
			})
		})
	}
}

func TestAttachRefused(t *testing.T) {
	r := newRig(t, 2)
	tp := mustNew(t, inproc.Config{})
	r.to.Release()
	tr, err := tp.Start(r.pairs, r.attachBoth)
	if tr != nil || !errors.Is(err, kvlease.ErrLeaseClosed) {
		t.Fatalf("Start = %v, %v", tr, err)
	}
	tp.Wait()
	if !reflect.DeepEqual(r.copied(), []bool{false, false}) {
		t.Fatal("a refused transfer copied")
	}
	if got := tp.Stats(); got != (inproc.Stats{Refused: 1}) {
		t.Fatalf("stats %+v", got)
	}
	// The source attachment that succeeded was resolved: the source lease
	// is free to settle.
	r.from.Release()
	if s := r.src.Stats(); s.Free != 16 {
		t.Fatalf("source %+v", s)
	}
}

func TestHooks(t *testing.T) {
	r := newRig(t, 3)
	var writes []string
	stop := errors.New("destination no longer owned")
	tp := mustNew(t, inproc.Config{
		BeforeWrite: func(w inproc.Write) error {
			writes = append(writes, fmt.Sprintf("before %d/%d", w.Seq, w.Pair))
			if w.Transfer == nil || &w.Dst[0] != &r.pairs[w.Pair].Dst[0] {
				return errors.New("bad write description")
			}
			if w.Pair == 2 {
				return stop
			}
			return nil
		},
		AfterWrite: func(w inproc.Write) { writes = append(writes, fmt.Sprintf("after %d/%d", w.Seq, w.Pair)) },
	})
	tr, err := tp.Start(r.pairs, r.attachBoth)
	if err != nil {
		t.Fatal(err)
	}
	tp.Wait()
	if !errors.Is(tr.Err(), stop) {
		t.Fatalf("outcome %v", tr.Err())
	}
	want := []string{"before 0/0", "after 0/0", "before 0/1", "after 0/1", "before 0/2"}
	if !reflect.DeepEqual(writes, want) || !reflect.DeepEqual(r.copied(), []bool{true, true, false}) {
		t.Fatalf("writes %v, copied %v", writes, r.copied())
	}
}

// TestDeterministic: the same seed and the same Start order give the same
// outcomes, transfer by transfer.
func TestDeterministic(t *testing.T) {
	run := func(seed uint64) []string {
		tp := mustNew(t, inproc.Config{Seed: seed, FailRate: 0.3, LostAckRate: 0.2})
		var out []string
		for range 40 {
			r := newRig(t, 4)
			tr, err := tp.Start(r.pairs, r.attachBoth)
			if err != nil {
				t.Fatal(err)
			}
			tp.Wait()
			out = append(out, fmt.Sprintf("%v %v %v", tr.State(), tr.Err() != nil, r.copied()))
		}
		return out
	}
	a, b, c := run(7), run(7), run(8)
	if !reflect.DeepEqual(a, b) {
		t.Fatalf("same seed, different outcomes:\n%v\n%v", a, b)
	}
	if reflect.DeepEqual(a, c) {
		t.Fatal("different seeds, same outcomes")
	}
	kinds := map[string]bool{}
	for _, o := range a {
		kinds[o[:8]] = true
	}
	if len(kinds) < 2 {
		t.Fatalf("40 draws at 30%%/20%% gave one kind of outcome: %v", a)
	}
}

func TestBadInput(t *testing.T) {
	for _, cfg := range []inproc.Config{
		{FailRate: -0.1}, {LostAckRate: 1.5}, {IgnoreCancelRate: 2},
		{FailRate: 0.6, LostAckRate: 0.6}, {BlockLatency: -1}, {Jitter: -time.Second},
	} {
		if _, err := inproc.New(cfg); !errors.Is(err, kvlease.ErrInvalidArgument) {
			t.Errorf("New(%+v) = %v", cfg, err)
		}
	}
	tp := mustNew(t, inproc.Config{})
	if _, err := tp.Start(nil, nil); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Errorf("nil attach: %v", err)
	}
	short := []kvlease.CopyPair[[]byte, []byte]{{Src: make([]byte, 4), Dst: make([]byte, 3)}}
	called := false
	if _, err := tp.Start(short, func(*kvlease.Transfer) error { called = true; return nil }); !errors.Is(err, kvlease.ErrInvalidArgument) || called {
		t.Errorf("mismatched pair: %v (attach called %v)", err, called)
	}
	// No pairs: a transfer that resolves at once.
	tr, err := tp.Start(nil, func(*kvlease.Transfer) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	<-tr.Done()
	if tr.Err() != nil {
		t.Fatal(tr.Err())
	}
	for f, s := range map[inproc.Fate]string{inproc.FateComplete: "complete", inproc.FateFail: "fail", inproc.FateLoseAck: "lose-ack", 9: "fate(?)"} {
		if f.String() != s {
			t.Errorf("%d.String() = %q", f, f.String())
		}
	}
}
