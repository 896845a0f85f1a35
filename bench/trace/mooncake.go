package trace

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// The Mooncake trace format is the public trace of Moonshot AI's Mooncake
// serving platform, used by KV-cache research and serving benchmarks: one
// JSON object per line,
//
//	{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}
//
// timestamp is the arrival in milliseconds; input_length and
// output_length count tokens; hash_ids names the prompt's blocks of
// MooncakeBlockTokens tokens each (the last may be partial), where equal
// ids at the start of two prompts mean a shared prefix (the ids are
// chained: an id stands for its block and everything before it).
//
// FromMooncake turns such a trace into a Trace whose prompts are made of
// those blocks (Prompt.HashIDs): block id's tokens are HashToken(id, i),
// so prompts that share leading ids share their leading tokens, and the
// replay engine's chain hashes (at any block size that divides 512, or
// not) find exactly the sharing the trace describes.

// MooncakeBlockTokens is the tokens per hash id in a Mooncake trace.
const MooncakeBlockTokens = 512

// MooncakeRequest is one line of a Mooncake trace.
type MooncakeRequest struct {
	Timestamp    int64   `json:"timestamp"`     // arrival, ms
	InputLength  int     `json:"input_length"`  // prompt tokens
	OutputLength int     `json:"output_length"` // tokens generated
	HashIDs      []int64 `json:"hash_ids"`      // one per 512-token block of the prompt
}

// ReadMooncake parses a Mooncake trace: one object per line, unknown keys
// ignored (published traces vary in extra fields). It checks each line:
// timestamps never decrease, input_length ≥ 1 with exactly
// ceil(input_length/512) hash ids, each ≥ 0, output_length ≥ 1.
func ReadMooncake(r io.Reader) ([]MooncakeRequest, error) {
	dec := json.NewDecoder(bufio.NewReader(r))
	var reqs []MooncakeRequest
	var last int64
	for n := 1; ; n++ {
		var m MooncakeRequest
		err := dec.Decode(&m)
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("trace: mooncake object %d: %w", n, err)
		}
		if err := m.check(last); err != nil {
			return nil, fmt.Errorf("trace: mooncake object %d: %w", n, err)
		}
		last = m.Timestamp
		reqs = append(reqs, m)
	}
	return reqs, nil
}

func (m *MooncakeRequest) check(last int64) error {
	var errs []error
	if m.Timestamp < last {
		errs = append(errs, fmt.Errorf("timestamp %d before the previous line's %d", m.Timestamp, last))
	}
	if m.InputLength < 1 || m.OutputLength < 1 {
		errs = append(errs, fmt.Errorf("input_length %d, output_length %d: both must be ≥ 1", m.InputLength, m.OutputLength))
	}
	if want := (m.InputLength + MooncakeBlockTokens - 1) / MooncakeBlockTokens; m.InputLength >= 1 && len(m.HashIDs) != want {
		errs = append(errs, fmt.Errorf("%d hash_ids for input_length %d: want %d (one per %d tokens)",
			len(m.HashIDs), m.InputLength, want, MooncakeBlockTokens))
	}
	for _, id := range m.HashIDs {
		if id < 0 {
			errs = append(errs, fmt.Errorf("negative hash id %d", id))
			break
		}
	}
	return errors.Join(errs...)
}

// WriteMooncake writes reqs as a Mooncake trace.
func WriteMooncake(w io.Writer, reqs []MooncakeRequest) error {
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	for i := range reqs {
		if err := enc.Encode(&reqs[i]); err != nil {
			return err
		}
	}
	return bw.Flush()
}

// HashToken is token i of the Mooncake block named id.
func HashToken(id int64, i int) int32 {
	return int32(mix(0x3c6ef372fe94f82b^uint64(id)*0x9e3779b97f4a7c15+uint64(i)) % Vocab)
}

// FromMooncake converts a Mooncake trace into a Trace: request i gets id
// i, arrives at engine step timestamp/msPerStep (msPerStep ≤ 0 means 1),
// its prompt is its hash_ids blocks cut to input_length tokens, and it
// generates output_length tokens (from private stream i).
func FromMooncake(reqs []MooncakeRequest, msPerStep float64) *Trace {
	if msPerStep <= 0 {
		msPerStep = 1
	}
	t := &Trace{Header: Header{Format: Format, Note: "converted from a Mooncake trace"}}
	t.Requests = make([]Request, len(reqs))
	for i, m := range reqs {
		t.Requests[i] = Request{ID: i, Arrival: int(float64(m.Timestamp) / msPerStep), MaxNew: m.OutputLength,
			Prompt: Prompt{HashIDs: m.HashIDs, HashLen: m.InputLength, Seed: uint64(i)}}
	}
	return t
}

// MooncakeGenConfig describes a synthetic Mooncake trace shaped like
// production prefix-heavy traffic: long prompts that start with one of a
// few shared prefixes (system prompts, documents, earlier turns) of skewed
// popularity and end in blocks of their own.
type MooncakeGenConfig struct {
	Seed         uint64  `json:"seed"`
	Requests     int     `json:"requests"`
	InputMean    int     `json:"input_mean"`    // mean prompt tokens (±50%)
	OutputMean   int     `json:"output_mean"`   // mean output tokens (±50%)
	Prefixes     int     `json:"prefixes"`      // distinct shared prefixes
	SharedFrac   float64 `json:"shared_frac"`   // mean share of a prompt's blocks that is its shared prefix
	IntervalMean float64 `json:"interval_mean"` // mean ms between arrivals (exponential)
}

// ProductionMooncake is the shape BenchmarkProductionReplay measures: prompts of about
// 12,000 tokens (≈ 750 blocks of 16), half of each a shared prefix, from
// 64 prefixes.
func ProductionMooncake() MooncakeGenConfig {
	return MooncakeGenConfig{Seed: 16, Requests: 2000, InputMean: 12000, OutputMean: 300,
		Prefixes: 64, SharedFrac: 0.5, IntervalMean: 50}
}

// GenerateMooncake makes a trace from cfg, deterministically: prefix p's
// k-th block is id p·2^20 + k, so requests with the same prefix share
// their leading ids; every other block gets a fresh id above all of
// those. Prefix popularity falls as 1/(rank+1).
func GenerateMooncake(cfg MooncakeGenConfig) []MooncakeRequest {
	r := &rng{s: cfg.Seed}
	prefixes := max(cfg.Prefixes, 1)
	weights := make([]float64, prefixes)
	total := 0.0
	for i := range weights {
		weights[i] = 1 / float64(i+1)
		total += weights[i]
	}
	pick := func() int {
		x := r.float() * total
		for i, w := range weights {
			if x < w {
				return i
			}
			x -= w
		}
		return prefixes - 1
	}
	next := int64(prefixes) << 20 // fresh ids start above every prefix's
	reqs := make([]MooncakeRequest, cfg.Requests)
	ms := 0.0
	for i := range reqs {
		in := max(1, r.around(cfg.InputMean))
		blocks := (in + MooncakeBlockTokens - 1) / MooncakeBlockTokens
		shared := min(blocks, int(float64(blocks)*cfg.SharedFrac*(0.5+r.float())))
		p := int64(pick())
		ids := make([]int64, blocks)
		for k := range ids {
			if k < shared {
				ids[k] = p<<20 + int64(k)
			} else {
				ids[k] = next
				next++
			}
		}
		reqs[i] = MooncakeRequest{Timestamp: int64(ms), InputLength: in,
			OutputLength: max(1, r.around(cfg.OutputMean)), HashIDs: ids}
		ms += cfg.IntervalMean * expSample(r)
	}
	return reqs
}
