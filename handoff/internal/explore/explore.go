// Package explore is a stateless model checker for systems whose every
// step is a choice: it drives real code (goroutines, pools, sockets
// stood in for by fakes) through every schedule up to a bound, or
// through seeded random walks, and checks properties after each step.
//
// The system's state cannot be copied (it is the real code's), so every
// run starts from the initial state and replays its path: a run is a
// function of its choice sequence, and a failing run is printed as that
// sequence and replays exactly (Replay). Exhaustive is a depth-first
// search with state hashing: a state whose fingerprint was already
// expanded at the same or a smaller depth is not expanded again, so
// interleavings that meet in one abstract state are explored once. A
// fingerprint that differs when a path is replayed is reported: the
// system did not do the same thing twice, which is either a race in the
// code under test or something the instance must canonicalise.
//
// The package knows nothing of handoffs; handoff's explore_test.go is
// its system.
package explore

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"
)

// Instance is one run of the system under exploration, from its initial
// state. The engine calls it from one goroutine.
type Instance interface {
	// Choices returns the choices enabled now, each named so that the
	// name identifies it among them, in an order that depends only on the
	// state. None: nothing can happen any more.
	Choices() []string
	// Settled reports whether every enabled choice is optional (a call
	// the system's users may never make, a fault that may never happen):
	// left alone, the system is quiescent, and liveness must hold.
	Settled() bool
	// Apply takes one of Choices and returns once the system is
	// quiescent again; an error is a violation found during the step.
	Apply(choice string) error
	// Fingerprint hashes the abstract state: two states with the same
	// fingerprint have the same futures as far as the properties see.
	Fingerprint() uint64
	// Check returns the safety violations of the current state.
	Check() error
	// Quiescent returns the liveness violations of a settled state.
	Quiescent() error
	// Finish tears the run down (the engine calls it once, last) and
	// returns the violations of what must hold after.
	Finish() error
	// Describe renders the current state for a counterexample.
	Describe() string
}

// Weighted is an Instance whose random walks draw some choices more
// often than others (faults rarely, progress often), as a simulation
// injects faults: Weight returns a choice's relative weight (at least 1).
type Weighted interface {
	Weight(choice string) int
}

// Runner starts a fresh instance and runs body over it (inside whatever
// the instance needs around it: a synctest bubble). It returns once body
// and the instance's teardown have returned.
type Runner func(body func(Instance))

// Bounds limit an exploration.
type Bounds struct {
	// Depth is the most steps a run may take (0: no bound).
	Depth int
	// States stops the search once it has expanded this many states
	// (0: no bound); the result is then Incomplete.
	States int
}

// Result is what an exploration covered, and the counterexample it
// found, if any.
type Result struct {
	States      int           // distinct fingerprints expanded
	Transitions int           // steps taken, replays not counted
	Replayed    int           // steps re-taken to reach a branch point
	Runs        int           // runs (each from the initial state)
	Terminal    int           // settled states reached (their liveness checked)
	Cut         int           // states left unexpanded at the depth bound
	MaxDepth    int           // the longest run, in steps
	Incomplete  bool          // Bounds.States stopped the search
	Elapsed     time.Duration // wall time
	Fail        *Counterexample
}

// StatesPerSecond is the rate of distinct states expanded.
func (r Result) StatesPerSecond() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.States) / r.Elapsed.Seconds()
}

func (r Result) String() string {
	s := fmt.Sprintf("%d states, %d transitions (+%d replayed) in %d runs, %d settled, depth %d, %d cut at the bound, %v (%.0f states/s)",
		r.States, r.Transitions, r.Replayed, r.Runs, r.Terminal, r.MaxDepth, r.Cut, r.Elapsed.Round(time.Millisecond), r.StatesPerSecond())
	if r.Incomplete {
		s += ", incomplete (state bound)"
	}
	return s
}

// Counterexample is a run that broke a property: its choices from the
// initial state, what broke, and the state it broke in.
type Counterexample struct {
	Path  []string
	Err   error
	State string
	Seed  uint64 // the walk's seed, for a random walk
}

func (c *Counterexample) Error() string {
	return fmt.Sprintf("after %d steps: %v\n  path: %s\n  state:\n%s", len(c.Path), c.Err, FormatPath(c.Path), indent(c.State, "    "))
}

func (c *Counterexample) Unwrap() error { return c.Err }

// ErrNondeterministic is wrapped by the violation reported when a replay
// of a path reaches another state than the first run did.
var ErrNondeterministic = errors.New("explore: the same choices reached another state")

// FormatPath renders a path as ParsePath reads it: the choices, "; "
// between them.
func FormatPath(path []string) string { return strings.Join(path, "; ") }

// ParsePath reads a path that FormatPath printed.
func ParsePath(s string) []string {
	var path []string
	for c := range strings.SplitSeq(s, ";") {
		if c = strings.TrimSpace(c); c != "" {
			path = append(path, c)
		}
	}
	return path
}

func indent(s, prefix string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i := range lines {
		lines[i] = prefix + lines[i]
	}
	return strings.Join(lines, "\n")
}

// step applies c and checks safety; the error is the violation.
func step(in Instance, c string) error {
	if err := in.Apply(c); err != nil {
		return err
	}
	return in.Check()
}

// finish runs Finish, folding its violation into fail if none was found
// before it.
func finish(in Instance, path []string, fail **Counterexample) {
	err := in.Finish()
	if err != nil && *fail == nil {
		*fail = &Counterexample{Path: slices.Clone(path), Err: fmt.Errorf("after teardown: %w", err), State: in.Describe()}
	}
}

// frame is one state on the search's stack: its fingerprint, its
// choices, and how many of them were taken.
type frame struct {
	fp      uint64
	choices []string
	next    int
}

// Exhaustive explores every run of at most b.Depth steps, depth first,
// expanding each abstract state once (again only when reached at a
// smaller depth, where more of its future fits under the bound). It
// stops at the first violation.
func Exhaustive(run Runner, b Bounds) (r Result) {
	start := time.Now()
	defer func() { r.Elapsed = time.Since(start) }()
	seen := map[uint64]int{} // fingerprint → the smallest depth it was expanded at
	var stack []frame
	expand := func(in Instance, path []string) error {
		// The state at the top of path is new (or newly shallower): check
		// it is quiescent or note its choices.
		depth := len(path)
		r.MaxDepth = max(r.MaxDepth, depth)
		r.States++
		cs := in.Choices()
		if len(cs) == 0 || in.Settled() {
			r.Terminal++
			if err := in.Quiescent(); err != nil {
				return fmt.Errorf("quiescent: %w", err)
			}
		}
		if b.Depth > 0 && depth >= b.Depth && len(cs) > 0 {
			r.Cut++
			cs = nil
		}
		stack = append(stack, frame{fp: in.Fingerprint(), choices: cs})
		return nil
	}
	for {
		var fail *Counterexample
		run(func(in Instance) {
			r.Runs++
			var path []string
			defer func() { finish(in, path, &fail) }()
			if len(stack) == 0 {
				if err := in.Check(); err != nil {
					fail = &Counterexample{Err: err, State: in.Describe()}
					return
				}
				seen[in.Fingerprint()] = 0
				if err := expand(in, nil); err != nil {
					fail = &Counterexample{Err: err, State: in.Describe()}
					return
				}
			} else {
				// (The fingerprint is compared once, where the replay
				// ends: a difference that lasts shows there.)
				for i := 0; i < len(stack)-1; i++ {
					c := stack[i].choices[stack[i].next-1]
					path = append(path, c)
					r.Replayed++
					if err := in.Apply(c); err != nil {
						fail = &Counterexample{Path: slices.Clone(path), Err: fmt.Errorf("replay: %w", err), State: in.Describe()}
						return
					}
				}
				if fp := in.Fingerprint(); fp != stack[len(stack)-1].fp {
					fail = &Counterexample{Path: slices.Clone(path), Err: fmt.Errorf("%w (a replay of %d steps)", ErrNondeterministic, len(path)), State: in.Describe()}
					return
				}
			}
			for {
				top := &stack[len(stack)-1]
				if top.next >= len(top.choices) {
					return
				}
				c := top.choices[top.next]
				top.next++
				path = append(path, c)
				r.Transitions++
				if err := step(in, c); err != nil {
					fail = &Counterexample{Path: slices.Clone(path), Err: err, State: in.Describe()}
					return
				}
				fp, depth := in.Fingerprint(), len(path)
				if d, ok := seen[fp]; ok && d <= depth {
					return // explored from here already, with at least as many steps left
				}
				seen[fp] = depth
				if err := expand(in, path); err != nil {
					fail = &Counterexample{Path: slices.Clone(path), Err: err, State: in.Describe()}
					return
				}
				if b.States > 0 && r.States >= b.States {
					r.Incomplete = true
					return
				}
			}
		})
		if fail != nil {
			r.Fail = fail
			return r
		}
		if r.Incomplete {
			return r
		}
		for len(stack) > 0 && stack[len(stack)-1].next >= len(stack[len(stack)-1].choices) {
			stack = stack[:len(stack)-1]
		}
		if len(stack) == 0 {
			return r
		}
	}
}

// Deepen runs Exhaustive with depth bounds 1, 2, … up to most, and
// returns the first result with a counterexample (found at the smallest
// depth that has one, so its path is a shortest), or the last result.
func Deepen(run Runner, most int) Result {
	var r Result
	for d := 1; d <= most; d++ {
		r = Exhaustive(run, Bounds{Depth: d})
		if r.Fail != nil || r.Cut == 0 {
			return r // found, or nothing deeper to explore
		}
	}
	return r
}

// Walk takes walks random runs of at most steps steps each, every choice
// drawn from those enabled (uniformly, or by Weight when the instance is
// Weighted) by a generator seeded with (seed, walk number), and stops at
// the first violation (its Seed says which walk). States counts the
// distinct fingerprints the walks passed.
func Walk(run Runner, seed uint64, walks, steps int) (r Result) {
	start := time.Now()
	defer func() { r.Elapsed = time.Since(start) }()
	seen := map[uint64]bool{}
	for w := range walks {
		rng := rand.New(rand.NewPCG(seed, uint64(w)))
		var fail *Counterexample
		run(func(in Instance) {
			r.Runs++
			var path []string
			defer func() { finish(in, path, &fail) }()
			if err := in.Check(); err != nil {
				fail = &Counterexample{Err: err, State: in.Describe()}
				return
			}
			for {
				if fp := in.Fingerprint(); !seen[fp] {
					seen[fp] = true
					r.States++
				}
				cs := in.Choices()
				if len(cs) == 0 || in.Settled() {
					r.Terminal++
					if err := in.Quiescent(); err != nil {
						fail = &Counterexample{Path: slices.Clone(path), Err: fmt.Errorf("quiescent: %w", err), State: in.Describe()}
						return
					}
				}
				if len(cs) == 0 {
					return
				}
				if len(path) >= steps {
					r.Cut++
					return
				}
				c := draw(in, cs, rng)
				path = append(path, c)
				r.Transitions++
				r.MaxDepth = max(r.MaxDepth, len(path))
				if err := step(in, c); err != nil {
					fail = &Counterexample{Path: slices.Clone(path), Err: err, State: in.Describe()}
					return
				}
			}
		})
		if fail != nil {
			fail.Seed = seed
			r.Fail = fail
			return r
		}
	}
	return r
}

// Replay takes path's choices by name from the initial state, checking
// safety after each step and liveness if it ends quiescent, then tears
// down. The error is the violation (a *Counterexample), or a choice that
// is not enabled where the path takes it.
func Replay(run Runner, path []string) error {
	var fail *Counterexample
	run(func(in Instance) {
		var done []string
		defer func() { finish(in, done, &fail) }()
		if err := in.Check(); err != nil {
			fail = &Counterexample{Err: err, State: in.Describe()}
			return
		}
		for i, c := range path {
			if cs := in.Choices(); !slices.Contains(cs, c) {
				fail = &Counterexample{Path: slices.Clone(done), Err: fmt.Errorf("step %d: %q is not enabled; enabled: %s", i+1, c, FormatPath(cs)), State: in.Describe()}
				return
			}
			done = append(done, c)
			if err := step(in, c); err != nil {
				fail = &Counterexample{Path: slices.Clone(done), Err: err, State: in.Describe()}
				return
			}
		}
		if len(in.Choices()) == 0 || in.Settled() {
			if err := in.Quiescent(); err != nil {
				fail = &Counterexample{Path: slices.Clone(done), Err: fmt.Errorf("quiescent: %w", err), State: in.Describe()}
			}
		}
	})
	if fail != nil {
		return fail
	}
	return nil
}

// draw picks one of cs, by weight when in is Weighted.
func draw(in Instance, cs []string, rng *rand.Rand) string {
	wi, ok := in.(Weighted)
	if !ok {
		return cs[rng.IntN(len(cs))]
	}
	total := 0
	ws := make([]int, len(cs))
	for i, c := range cs {
		ws[i] = max(1, wi.Weight(c))
		total += ws[i]
	}
	n := rng.IntN(total)
	for i, w := range ws {
		if n < w {
			return cs[i]
		}
		n -= w
	}
	return cs[len(cs)-1]
}
