package trace

import (
	"math"
	"sort"
)

// GenConfig parameterises Generate. Lengths are in tokens; each drawn
// length is uniform in [mean/2, 3·mean/2]. Zero fields take
// DefaultGenConfig's values, except the fractions, which are used as
// given.
type GenConfig struct {
	Seed     uint64 `json:"seed"`
	Requests int    `json:"requests"` // total requests, turns included

	// Shared system prompts: a request that is not a long-context outlier
	// starts with one of SystemPrompts streams (chosen with a skew: prompt
	// k is half as likely as prompt k-1) with probability SharedFrac.
	SystemPrompts int     `json:"system_prompts"`
	SystemLen     int     `json:"system_len"`
	SharedFrac    float64 `json:"shared_frac"`

	// Multi-turn conversations: with probability ConvFrac a new session is
	// a conversation of 2..Turns turns. Turn k+1 arrives ThinkSteps steps
	// after turn k would have finished (arrival + its max_new) and its
	// suffix covers the earlier turns' messages and answers.
	ConvFrac   float64 `json:"conv_frac"`
	Turns      int     `json:"turns"`
	ThinkSteps int     `json:"think_steps"`

	UserLen int `json:"user_len"` // a user message (a single-turn suffix)
	MaxNew  int `json:"max_new"`  // mean max_new

	// Long-context outliers: with probability LongFrac a single-turn
	// request has a private prompt of about LongLen tokens.
	LongFrac float64 `json:"long_frac"`
	LongLen  int     `json:"long_len"`

	// AbortFrac of requests get an abort event at a uniform step in
	// [0, max_new).
	AbortFrac float64 `json:"abort_frac"`

	// ArrivalsPerStep is the mean arrival rate of new sessions
	// (exponential inter-arrival times, rounded down to whole steps).
	ArrivalsPerStep float64 `json:"arrivals_per_step"`
}

// DefaultGenConfig is a chat-serving mix: four system prompts, a third of
// sessions multi-turn, 2% long-context outliers, 5% aborts.
func DefaultGenConfig() GenConfig {
	return GenConfig{
		Seed: 1, Requests: 1000,
		SystemPrompts: 4, SystemLen: 512, SharedFrac: 0.8,
		ConvFrac: 0.3, Turns: 4, ThinkSteps: 20,
		UserLen: 96, MaxNew: 160,
		LongFrac: 0.02, LongLen: 8192,
		AbortFrac:       0.05,
		ArrivalsPerStep: 0.5,
	}
}

func (c GenConfig) withDefaults() GenConfig {
	d := DefaultGenConfig()
	def := func(v *int, dv int) {
		if *v <= 0 {
			*v = dv
		}
	}
	def(&c.Requests, d.Requests)
	def(&c.SystemPrompts, d.SystemPrompts)
	def(&c.SystemLen, d.SystemLen)
	def(&c.Turns, d.Turns)
	def(&c.UserLen, d.UserLen)
	def(&c.MaxNew, d.MaxNew)
	def(&c.LongLen, d.LongLen)
	if c.ThinkSteps < 0 {
		c.ThinkSteps = 0
	}
	if c.ArrivalsPerStep <= 0 {
		c.ArrivalsPerStep = d.ArrivalsPerStep
	}
	return c
}

// rng is splitmix64: tiny, and its output is fixed forever, so a seed
// names the same trace in every Go release.
type rng struct{ s uint64 }

func (r *rng) next() uint64 {
	r.s += 0x9e3779b97f4a7c15
	return mix(r.s)
}

// float returns a uniform float in [0, 1).
func (r *rng) float() float64 { return float64(r.next()>>11) / (1 << 53) }

// intn returns a uniform int in [0, n).
func (r *rng) intn(n int) int { return int(r.next() % uint64(n)) }

// expSample returns an exponential sample of mean 1.
func expSample(r *rng) float64 { return -math.Log(1 - r.float()) }

// around returns a length uniform in [mean/2, 3·mean/2], at least 1.
func (r *rng) around(mean int) int {
	lo := max(mean/2, 1)
	return lo + r.intn(max(mean, 1)+1)
}

// Generate returns a synthetic trace; the same config gives the same trace.
// Sessions arrive as a Poisson process; a session is a single request
// (maybe sharing a system prompt, maybe a long-context outlier) or a
// multi-turn conversation whose turns arrive after one another. Requests
// are numbered in arrival order.
func Generate(cfg GenConfig) *Trace {
	c := cfg.withDefaults()
	r := &rng{s: c.Seed}
	type pending struct {
		req Request
		seq int // creation order breaks arrival ties
	}
	var reqs []pending
	add := func(q Request) { reqs = append(reqs, pending{q, len(reqs)}) }
	var clock float64
	for len(reqs) < c.Requests {
		clock += -math.Log(1-r.float()) / c.ArrivalsPerStep
		at := int(clock)
		sys := func(p *Prompt) {
			if r.float() < c.SharedFrac {
				k := 0
				for k < c.SystemPrompts-1 && r.float() < 0.5 {
					k++
				}
				p.PrefixID, p.PrefixLen = k+1, c.SystemLen
			}
		}
		abort := func(q *Request) {
			if r.float() < c.AbortFrac {
				q.Events = []Event{{Step: r.intn(q.MaxNew), Kind: EventAbort}}
			}
		}
		seed := r.next()
		switch u := r.float(); {
		case u < c.ConvFrac:
			var p Prompt
			sys(&p)
			p.Seed = seed
			turns := 2 + r.intn(max(c.Turns-1, 1))
			history := 0
			for range turns {
				if len(reqs) >= c.Requests {
					break
				}
				q := Request{Arrival: at, MaxNew: r.around(c.MaxNew), Prompt: p}
				q.Prompt.SuffixLen = history + r.around(c.UserLen)
				abort(&q)
				add(q)
				history = q.Prompt.SuffixLen + q.MaxNew
				at += q.MaxNew + c.ThinkSteps
			}
		case u < c.ConvFrac+c.LongFrac:
			q := Request{Arrival: at, MaxNew: r.around(c.MaxNew),
				Prompt: Prompt{SuffixLen: r.around(c.LongLen), Seed: seed}}
			abort(&q)
			add(q)
		default:
			q := Request{Arrival: at, MaxNew: r.around(c.MaxNew), Prompt: Prompt{Seed: seed}}
			sys(&q.Prompt)
			q.Prompt.SuffixLen = r.around(c.UserLen)
			abort(&q)
			add(q)
		}
	}
	sort.SliceStable(reqs, func(i, j int) bool {
		if reqs[i].req.Arrival != reqs[j].req.Arrival {
			return reqs[i].req.Arrival < reqs[j].req.Arrival
		}
		return reqs[i].seq < reqs[j].seq
	})
	t := &Trace{Header: Header{Format: Format, Generator: &c}}
	t.Requests = make([]Request, len(reqs))
	for i := range reqs {
		t.Requests[i] = reqs[i].req
		t.Requests[i].ID = i
	}
	return t
}
