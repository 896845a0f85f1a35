package kvlease_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/kvlease/kvlease"
)

// Linearizability of the pool's core API: clients call Acquire,
// AcquirePrefix, AcquireWait, Extend, Seal, Release, Abort, AttachRange,
// Resolve, Quarantine, Cancel and Stats at once on a small pool; each call
// is recorded with its call and return times (a logical clock), and
// porcupine searches for an order of the calls, each taking effect at
// one instant between its call and its return, in which the sequential
// model (linearize_model_test.go) produces every result observed. Every
// history must have one.
//
// AcquireWait is two operations over the same interval: entering (served
// at once, failed by the quarantine bound, or queued) and leaving (with
// its lease, the bound or its context's error): its effect on others
// (plain acquires refused while it waits) happens while it is queued,
// not at one instant. A cancel hook only records that it ran (at most
// once per transfer, checked apart): Abort calls Cancel after it closed
// the lease, so a hook is not part of one instant.

// linModel is the model as porcupine takes it.
var linModel = (&porcupine.NondeterministicModel{
	Init: func() []interface{} { return []interface{}{newMState(linCapacity)} },
	Step: func(state, input, output interface{}) []interface{} {
		var out []interface{}
		for _, s := range step(state.(*mState), input.(lin), output.(linOut)) {
			out = append(out, s)
		}
		return out
	},
	Equal:             func(a, b interface{}) bool { return a.(*mState).String() == b.(*mState).String() },
	Hash:              func(s interface{}) uint64 { return s.(*mState).hashOf() },
	DescribeOperation: func(in, out interface{}) string { return fmt.Sprintf("%v → %v", in, out) },
	DescribeState:     func(s interface{}) string { return s.(*mState).String() },
}).ToModel()

const linCapacity = 4

// linChain is the chain of hashes the clients seal and look up.
var linChain = []uint64{0x11, 0x22, 0x33}

// linWorld is one history's shared objects.
type linWorld struct {
	pool  *kvlease.Pool[[]byte]
	clock atomic.Int64

	mu        sync.Mutex
	leases    map[int]*kvlease.Lease[[]byte]
	transfers map[int]*kvlease.Transfer
	hooks     map[int]*atomic.Int32 // cancel hook runs per transfer
	next      int                   // handles for leases, transfers and waiters
	ops       []porcupine.Operation
}

func (w *linWorld) handle() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.next++
	return w.next
}

// pick returns a random existing lease (or transfer) handle, or 0.
func pick[V any](w *linWorld, m map[int]V, rng *rand.Rand) (int, V) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var zero V
	if len(m) == 0 {
		return 0, zero
	}
	k := rng.IntN(len(m))
	for h, v := range m {
		if k == 0 {
			return h, v
		}
		k--
	}
	return 0, zero
}

// errClass is the contract's name of err.
func errClass(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, kvlease.ErrQuarantineBound):
		return "bound"
	case errors.Is(err, kvlease.ErrExhausted):
		return "exhausted"
	case errors.Is(err, kvlease.ErrLeaseClosed):
		return "closed"
	case errors.Is(err, kvlease.ErrExceedsCapacity):
		return "exceeds"
	case errors.Is(err, kvlease.ErrInvalidArgument):
		return "invalid"
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return "canceled"
	}
	return "unexpected: " + err.Error()
}

// record runs f between two ticks of the clock and records it.
func (w *linWorld) record(client int, in lin, f func() linOut) linOut {
	call := w.clock.Add(1)
	out := f()
	ret := w.clock.Add(1)
	w.mu.Lock()
	w.ops = append(w.ops, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
	w.mu.Unlock()
	return out
}

// client makes ops random calls.
func (w *linWorld) client(id, ops int, rng *rand.Rand) {
	for range ops {
		switch k := rng.IntN(16); {
		case k < 2:
			h, n := w.handle(), 1+rng.IntN(3)
			w.record(id, lin{op: "acquire", lease: h, n: n}, func() linOut {
				l, err := w.pool.Acquire("c", n)
				return w.opened(h, l, err)
			})
		case k < 4:
			h, n := w.handle(), 1+rng.IntN(3)
			hashes := linChain[:1+rng.IntN(len(linChain))]
			w.record(id, lin{op: "prefix", lease: h, n: n, hashes: hashes}, func() linOut {
				l, hits, err := w.pool.AcquirePrefix("c", toHashes(hashes), n)
				out := w.opened(h, l, err)
				out.hits = hits
				return out
			})
		case k < 5:
			h, wt, n := w.handle(), w.handle(), 1+rng.IntN(3)
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rng.IntN(300))*time.Microsecond)
			call := w.clock.Add(1)
			l, err := w.pool.AcquireWait(ctx, "c", n)
			ret := w.clock.Add(1)
			cancel()
			out := w.opened(h, l, err)
			w.mu.Lock()
			w.ops = append(w.ops,
				porcupine.Operation{ClientId: id, Input: lin{op: "wait-enter", lease: h, n: n, waiter: wt}, Call: call, Output: linOut{}, Return: ret},
				porcupine.Operation{ClientId: id, Input: lin{op: "wait-exit", lease: h, n: n, waiter: wt}, Call: call, Output: out, Return: ret})
			w.mu.Unlock()
		case k < 6:
			if h, l := pick(w, w.leases, rng); l != nil {
				w.record(id, lin{op: "extend", lease: h, n: 1}, func() linOut { return linOut{err: errClass(l.Extend(1))} })
			}
		case k < 8:
			if h, l := pick(w, w.leases, rng); l != nil {
				i := rng.IntN(l.Len())
				hash := linChain[min(i, len(linChain)-1)]
				if rng.IntN(4) == 0 {
					hash = linChain[rng.IntN(len(linChain))]
				}
				w.record(id, lin{op: "seal", lease: h, i: i, hash: hash}, func() linOut {
					return linOut{err: errClass(l.Seal(i, kvlease.BlockHash(hash)))}
				})
			}
		case k < 10:
			if h, l := pick(w, w.leases, rng); l != nil {
				op := "release"
				if rng.IntN(2) == 0 {
					op = "abort"
				}
				w.record(id, lin{op: op, lease: h}, func() linOut {
					if op == "release" {
						l.Release()
					} else {
						l.Abort(nil)
					}
					return linOut{}
				})
			}
		case k < 12:
			if h, l := pick(w, w.leases, rng); l != nil {
				from := rng.IntN(l.Len() + 1)
				to := from + rng.IntN(l.Len()-from+1)
				write := rng.IntN(2) == 0
				x, t := w.transfer(rng)
				w.record(id, lin{op: "attach", lease: h, xfer: x, i: from, to: to, write: write}, func() linOut {
					a := kvlease.Read
					if write {
						a = kvlease.Write
					}
					return linOut{err: errClass(l.AttachRange(t, from, to, a))}
				})
			}
		case k < 14:
			if x, t := pick(w, w.transfers, rng); t != nil {
				failure := rng.IntN(2) == 0
				w.record(id, lin{op: "resolve", xfer: x, failure: failure}, func() linOut {
					var err error
					if failure {
						err = errors.New("failed")
					}
					return linOut{ok: t.Resolve(err)}
				})
			}
		case k < 15:
			if x, t := pick(w, w.transfers, rng); t != nil {
				op := "quarantine"
				if rng.IntN(2) == 0 {
					op = "cancel"
				}
				w.record(id, lin{op: op, xfer: x}, func() linOut {
					if op == "cancel" {
						t.Cancel()
					} else {
						t.Quarantine(nil)
					}
					return linOut{}
				})
			}
		default:
			w.record(id, lin{op: "stats"}, func() linOut {
				s := w.pool.Stats()
				return linOut{stats: [5]int{s.Free, s.Cached, s.Leased, s.Draining, s.Quarantined}}
			})
		}
	}
}

// opened records a lease an acquire returned under handle h.
func (w *linWorld) opened(h int, l *kvlease.Lease[[]byte], err error) linOut {
	if err == nil {
		w.mu.Lock()
		w.leases[h] = l
		w.mu.Unlock()
	}
	return linOut{err: errClass(err)}
}

// transfer returns a transfer to attach: a new one (its hook counts its
// runs), or an existing one.
func (w *linWorld) transfer(rng *rand.Rand) (int, *kvlease.Transfer) {
	if rng.IntN(3) == 0 {
		if x, t := pick(w, w.transfers, rng); t != nil {
			return x, t
		}
	}
	x := w.handle()
	runs := new(atomic.Int32)
	t := kvlease.NewTransfer(func() { runs.Add(1) })
	w.mu.Lock()
	w.transfers[x], w.hooks[x] = t, runs
	w.mu.Unlock()
	return x, t
}

func toHashes(hs []uint64) []kvlease.BlockHash {
	out := make([]kvlease.BlockHash, len(hs))
	for i, h := range hs {
		out[i] = kvlease.BlockHash(h)
	}
	return out
}

// linHistory runs clients clients of ops calls each on a fresh pool and
// returns the history.
func linHistory(t testing.TB, seed uint64, clients, ops int) (*linWorld, []porcupine.Operation) {
	mem, err := kvlease.NewHostMemory(linCapacity, 8)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := kvlease.NewPool[[]byte](mem)
	if err != nil {
		t.Fatal(err)
	}
	w := &linWorld{pool: pool, leases: map[int]*kvlease.Lease[[]byte]{}, transfers: map[int]*kvlease.Transfer{}, hooks: map[int]*atomic.Int32{}}
	var wg sync.WaitGroup
	for c := range clients {
		rng := rand.New(rand.NewPCG(seed, uint64(c)))
		wg.Go(func() { w.client(c, ops, rng) })
	}
	wg.Wait()
	return w, w.ops
}

// TestLinearizable checks concurrent histories of the pool's core API
// against the model, under -race in CI.
func TestLinearizable(t *testing.T) {
	histories, clients, ops := 300, 4, 20
	if raceEnabled {
		histories = 60
	}
	start := time.Now()
	var checked, calls, overlapped int
	for seed := range uint64(histories) {
		w, hist := linHistory(t, seed, clients, ops)
		res, info := porcupine.CheckOperationsVerbose(linModel, hist, 30*time.Second)
		switch res {
		case porcupine.Illegal:
			var b strings.Builder
			for _, op := range hist {
				fmt.Fprintf(&b, "  [%3d,%3d] client %d: %v → %v\n", op.Call, op.Return, op.ClientId, op.Input, op.Output)
			}
			for _, p := range info.PartialLinearizationsOperations() {
				fmt.Fprintf(&b, "longest linearization found (%d of %d calls):\n", len(p[0]), len(hist))
				for _, op := range p[0] {
					fmt.Fprintf(&b, "    %v → %v\n", op.Input, op.Output)
				}
				break
			}
			t.Fatalf("seed %d: history not linearizable:\n%s", seed, b.String())
		case porcupine.Unknown:
			t.Fatalf("seed %d: the checker timed out", seed)
		}
		checked++
		calls += len(hist)
		overlapped += overlaps(hist)
		for x, runs := range w.hooks {
			if n := runs.Load(); n > 1 {
				t.Fatalf("seed %d: transfer %d's cancel hook ran %d times", seed, x, n)
			}
		}
		if err := w.pool.Check(); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
	}
	el := time.Since(start)
	t.Logf("%d histories of %d clients × %d calls (%d operations, %d of them concurrent with another) linearizable in %v: %.0f histories/s",
		checked, clients, ops, calls, overlapped, el.Round(time.Millisecond), float64(checked)/el.Seconds())
}

// overlaps counts the operations whose interval meets another's (of
// another client: an AcquireWait's two halves share theirs).
func overlaps(hist []porcupine.Operation) int {
	n := 0
	for i, a := range hist {
		for j, b := range hist {
			if i != j && a.ClientId != b.ClientId && a.Call <= b.Return && b.Call <= a.Return {
				n++
				break
			}
		}
	}
	return n
}

// TestLinearizeRefuses: the checker and the model refuse histories the
// contract forbids, each a broken rule: two leases on more blocks than
// the pool has; blocks a pending transfer gates counted free once their
// lease closed (rule 2); a quarantine lifted without evidence (rule 4);
// a hit on a block sealed with another hash; a second winning Resolve.
// The same histories with the contract's answers are linearizable.
func TestLinearizeRefuses(t *testing.T) {
	type call struct {
		in  lin
		out linOut
	}
	seq := func(calls ...call) []porcupine.Operation {
		var h []porcupine.Operation
		for i, c := range calls {
			h = append(h, porcupine.Operation{Input: c.in, Output: c.out, Call: int64(2 * i), Return: int64(2*i + 1)})
		}
		return h
	}
	stats := func(free, cached, leased, draining, quarantined int) call {
		return call{lin{op: "stats"}, linOut{stats: [5]int{free, cached, leased, draining, quarantined}}}
	}
	ok := linOut{}
	cases := []struct {
		name      string
		bad, good []call
	}{
		{"more blocks than the pool has",
			[]call{{lin{op: "acquire", lease: 1, n: 3}, ok}, {lin{op: "acquire", lease: 2, n: 2}, ok}},
			[]call{{lin{op: "acquire", lease: 1, n: 3}, ok}, {lin{op: "acquire", lease: 2, n: 2}, linOut{err: "exhausted"}}}},
		{"a closed lease's gated blocks freed",
			[]call{{lin{op: "acquire", lease: 1, n: 2}, ok}, {lin{op: "attach", lease: 1, xfer: 2, i: 0, to: 2, write: true}, ok},
				{lin{op: "release", lease: 1}, ok}, stats(4, 0, 0, 0, 0)},
			[]call{{lin{op: "acquire", lease: 1, n: 2}, ok}, {lin{op: "attach", lease: 1, xfer: 2, i: 0, to: 2, write: true}, ok},
				{lin{op: "release", lease: 1}, ok}, stats(2, 0, 0, 2, 0)}},
		{"a quarantine lifted by time",
			[]call{{lin{op: "acquire", lease: 1, n: 1}, ok}, {lin{op: "attach", lease: 1, xfer: 2, i: 0, to: 1}, ok},
				{lin{op: "quarantine", xfer: 2}, ok}, {lin{op: "abort", lease: 1}, ok}, stats(4, 0, 0, 0, 0)},
			[]call{{lin{op: "acquire", lease: 1, n: 1}, ok}, {lin{op: "attach", lease: 1, xfer: 2, i: 0, to: 1}, ok},
				{lin{op: "quarantine", xfer: 2}, ok}, {lin{op: "abort", lease: 1}, ok}, stats(3, 0, 0, 0, 1)}},
		{"a hit on another hash",
			[]call{{lin{op: "acquire", lease: 1, n: 1}, ok}, {lin{op: "seal", lease: 1, i: 0, hash: 0x11}, ok}, {lin{op: "release", lease: 1}, ok},
				{lin{op: "prefix", lease: 2, n: 1, hashes: []uint64{0x22}}, linOut{hits: 1}}},
			[]call{{lin{op: "acquire", lease: 1, n: 1}, ok}, {lin{op: "seal", lease: 1, i: 0, hash: 0x11}, ok}, {lin{op: "release", lease: 1}, ok},
				{lin{op: "prefix", lease: 2, n: 1, hashes: []uint64{0x11}}, linOut{hits: 1}}}},
		{"two winning resolves",
			[]call{{lin{op: "resolve", xfer: 1}, linOut{ok: true}}, {lin{op: "resolve", xfer: 1}, linOut{ok: true}}},
			[]call{{lin{op: "resolve", xfer: 1}, linOut{ok: true}}, {lin{op: "resolve", xfer: 1}, linOut{ok: false}}}},
	}
	for _, c := range cases {
		if porcupine.CheckOperations(linModel, seq(c.bad...)) {
			t.Errorf("%s: accepted", c.name)
		}
		if !porcupine.CheckOperations(linModel, seq(c.good...)) {
			t.Errorf("%s: the contract's answers refused", c.name)
		}
	}
}
