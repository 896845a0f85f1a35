package explore

import (
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"testing"
)

// grid is a toy system: a point that moves right or up inside an n×n
// grid; bad, if set, is a cell that breaks safety, and stuck a cell
// whose quiescence is a liveness failure (a corner other than the top
// right one).
type grid struct {
	n, x, y  int
	bad      *[2]int
	finished *int
	trace    []string
}

func (g *grid) Choices() []string {
	var cs []string
	if g.x < g.n {
		cs = append(cs, "right")
	}
	if g.y < g.n {
		cs = append(cs, "up")
	}
	return cs
}

func (g *grid) Settled() bool { return false }

func (g *grid) Apply(c string) error {
	switch c {
	case "right":
		g.x++
	case "up":
		g.y++
	default:
		return fmt.Errorf("no choice %q", c)
	}
	g.trace = append(g.trace, c)
	return nil
}

func (g *grid) Fingerprint() uint64 {
	h := fnv.New64a()
	fmt.Fprintf(h, "%d,%d", g.x, g.y)
	return h.Sum64()
}

func (g *grid) Check() error {
	if g.bad != nil && g.x == g.bad[0] && g.y == g.bad[1] {
		return errors.New("bad cell")
	}
	return nil
}

func (g *grid) Quiescent() error {
	if g.x != g.n || g.y != g.n {
		return errors.New("stuck")
	}
	return nil
}

func (g *grid) Finish() error {
	*g.finished++
	return nil
}

func (g *grid) Describe() string { return fmt.Sprintf("at %d,%d", g.x, g.y) }

func gridRunner(n int, bad *[2]int, finished *int) Runner {
	return func(body func(Instance)) { body(&grid{n: n, bad: bad, finished: finished}) }
}

// TestExhaustiveCountsEveryState: a 4×4 grid has 25 states and 40 moves;
// the search expands each state once and takes each move once, and every
// run is finished.
func TestExhaustiveCountsEveryState(t *testing.T) {
	var finished int
	r := Exhaustive(gridRunner(4, nil, &finished), Bounds{})
	if r.Fail != nil {
		t.Fatal(r.Fail)
	}
	if r.States != 25 || r.Transitions != 40 || r.Terminal != 1 || r.MaxDepth != 8 || r.Cut != 0 {
		t.Fatalf("%v: want 25 states, 40 transitions, 1 quiescent, depth 8", r)
	}
	if finished != r.Runs {
		t.Fatalf("%d runs, %d finished", r.Runs, finished)
	}
}

// TestExhaustiveDepthBound: with a depth bound of 3 the search sees the
// 10 cells within 3 moves and cuts the 4 at the bound that can still move.
func TestExhaustiveDepthBound(t *testing.T) {
	var finished int
	r := Exhaustive(gridRunner(4, nil, &finished), Bounds{Depth: 3})
	if r.Fail != nil || r.States != 10 || r.Cut != 4 {
		t.Fatalf("%v, %v: want 10 states, 4 cut", r, r.Fail)
	}
}

// TestDeepenFindsShortest: the bad cell (2,1) is 3 moves away; Deepen
// finds it at depth 3 with a path of 3 moves that replays to the same
// violation.
func TestDeepenFindsShortest(t *testing.T) {
	var finished int
	run := gridRunner(4, &[2]int{2, 1}, &finished)
	r := Deepen(run, 10)
	if r.Fail == nil {
		t.Fatalf("%v: no counterexample", r)
	}
	if len(r.Fail.Path) != 3 || !strings.Contains(r.Fail.Error(), "bad cell") {
		t.Fatalf("counterexample %v", r.Fail)
	}
	err := Replay(run, ParsePath(FormatPath(r.Fail.Path)))
	var ce *Counterexample
	if !errors.As(err, &ce) || !slices.Equal(ce.Path, r.Fail.Path) {
		t.Fatalf("replay: %v", err)
	}
}

// TestLivenessAtQuiescence: a grid whose top row cannot be reached (the
// instance says it is quiescent at the right edge) fails liveness.
func TestLivenessAtQuiescence(t *testing.T) {
	var finished int
	run := func(body func(Instance)) { body(&edge{grid{n: 2, finished: &finished}}) }
	r := Exhaustive(run, Bounds{})
	if r.Fail == nil || !strings.Contains(r.Fail.Err.Error(), "stuck") {
		t.Fatalf("%v: %v", r, r.Fail)
	}
}

// edge is a grid that cannot move up from the right edge.
type edge struct{ grid }

func (e *edge) Choices() []string {
	if e.x == e.n {
		return nil
	}
	return e.grid.Choices()
}

// TestReplayRefusesADisabledChoice: a path that takes a choice the state
// does not offer is reported with what was enabled.
func TestReplayRefusesADisabledChoice(t *testing.T) {
	var finished int
	err := Replay(gridRunner(1, nil, &finished), []string{"right", "right"})
	if err == nil || !strings.Contains(err.Error(), `"right" is not enabled; enabled: up`) {
		t.Fatalf("replay: %v", err)
	}
}

// nondet is a grid whose fingerprint after the second run differs: the
// engine reports it instead of exploring a different system.
type nondet struct {
	grid
	run int
}

func (n *nondet) Fingerprint() uint64 {
	return n.grid.Fingerprint() + uint64(n.run)*uint64(len(n.trace))
}

func TestNondeterminismReported(t *testing.T) {
	var finished, runs int
	r := Exhaustive(func(body func(Instance)) {
		runs++
		body(&nondet{grid: grid{n: 2, finished: &finished}, run: runs})
	}, Bounds{})
	if r.Fail == nil || !errors.Is(r.Fail, ErrNondeterministic) {
		t.Fatalf("%v: %v", r, r.Fail)
	}
}

// TestWalkIsSeeded: two walks with one seed take the same paths.
func TestWalkIsSeeded(t *testing.T) {
	paths := func(seed uint64) []string {
		var got []string
		var finished int
		Walk(func(body func(Instance)) {
			g := &grid{n: 3, finished: &finished}
			body(g)
			got = append(got, strings.Join(g.trace, ","))
		}, seed, 5, 100)
		return got
	}
	a, b := paths(7), paths(7)
	if !slices.Equal(a, b) || len(a) != 5 {
		t.Fatalf("%v vs %v", a, b)
	}
	if slices.Equal(a, paths(8)) {
		t.Fatalf("seeds 7 and 8 walked alike: %v", a)
	}
}

func TestParsePath(t *testing.T) {
	p := []string{"deliver s>d propose 1", "src push 1"}
	if got := ParsePath(" " + FormatPath(p) + " ;"); !slices.Equal(got, p) {
		t.Fatalf("%q", got)
	}
}
