package handoff

import (
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/cespare/xxhash/v2"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/layout"
)

// An Envelope is the operating limits of a serving deployment: how big a
// block is, how many a pool has, and how large and how many requests the
// engine takes. Every component (front end, scheduler, each worker pool)
// carries one; they must agree (see AgreeEnvelopes), each must be valid
// (see Validate), and admission (see CheckRequest) answers from it before any
// block is acquired or any transfer starts.
//
// The incident this type exists for: a front end admitted a context length
// that the decode pool could not hold, so the decode side rejected a
// request that had already crossed the handoff. With one envelope,
// validated once and checked for agreement at startup, that request is
// refused at the front door instead.
//
// An Envelope is a plain value: copy it freely; its methods do not
// allocate unless they report a problem.
type Envelope struct {
	// BlockTokens is the number of tokens whose KV fits in one block (the
	// engine's block size, often 16).
	BlockTokens int
	// BlockBytes is the size of one block in bytes (all layers, keys and
	// values): the BlockBytes of the pool's Memory. A handoff copies whole
	// blocks, so both sides must use the same value.
	BlockBytes int
	// PoolBlocks is the number of blocks in the component's pool. Pools of
	// different components may differ in size (AgreeEnvelopes does not
	// compare it), but each must hold one maximum-context request.
	PoolBlocks int
	// MaxContextTokens is the most tokens one request may hold: prompt plus
	// generated tokens.
	MaxContextTokens int
	// MaxPrefillTokens is the prefill chunk: the most prompt tokens of one
	// request computed in one scheduler step. A longer prompt is prefilled
	// in PrefillSteps chunks.
	MaxPrefillTokens int
	// MaxRunningRequests is the most requests running at once. Each holds
	// at least one block.
	MaxRunningRequests int
	// Layout, if set, is the per-layer geometry of a block: how many
	// layers and pieces per layer it has, the bytes of one piece and the
	// element geometry (Tag). Only that counts (Layout.Fingerprint):
	// Blocks and the strides are each pool's own arrangement, so a
	// layer-separated device pool and a block-contiguous host pool agree
	// when their pieces do. Leave it zero for pools whose blocks are
	// opaque spans of BlockBytes; a pool whose memory describes a layout
	// (it has a Layout() layout.Layout method, as gpu's layered memories
	// and layout.Host do) needs its geometry named here, so that both
	// sides of a handoff compare it. Fingerprint covers it, so a
	// destination refuses a proposal from a source in another layout at
	// propose time; Propose, Source.Propose and NewDestination refuse a
	// pool whose layout the envelope does not name or contradicts. Every
	// such refusal wraps ErrInvalidArgument.
	Layout layout.Layout
}

// EnvelopeError reports every problem found in one envelope, or every
// field where several envelopes disagree. It wraps ErrInvalidArgument.
type EnvelopeError struct {
	// Problems lists each problem, one per field or relation, in field
	// order.
	Problems []EnvelopeProblem
}

// An EnvelopeProblem is one field (or one relation between fields) that is
// wrong, with the numbers involved.
type EnvelopeProblem struct {
	// Field names the field at fault, as spelled in Envelope.
	Field string
	// Detail says what is wrong, with the numbers.
	Detail string
}

func (p EnvelopeProblem) String() string { return p.Field + ": " + p.Detail }

func (e *EnvelopeError) Error() string {
	var b strings.Builder
	b.WriteString("kvlease: envelope: ")
	for i, p := range e.Problems {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(p.String())
	}
	return b.String()
}

// Unwrap returns ErrInvalidArgument.
func (e *EnvelopeError) Unwrap() error { return kvlease.ErrInvalidArgument }

func (e *EnvelopeError) add(field, format string, args ...any) {
	e.Problems = append(e.Problems, EnvelopeProblem{Field: field, Detail: fmt.Sprintf(format, args...)})
}

// err returns e as an error, or nil when it holds no problem.
func (e *EnvelopeError) err() error {
	if e == nil || len(e.Problems) == 0 {
		return nil
	}
	return e
}

// blocksFor is BlocksFor without the validity check: ceil(tokens /
// blockTokens) for tokens ≥ 0, blockTokens > 0, free of overflow.
func blocksFor(tokens, blockTokens int) int {
	n := tokens / blockTokens
	if tokens%blockTokens != 0 {
		n++
	}
	return n
}

// Validate reports every problem of the envelope at once, each with its
// numbers, as an *EnvelopeError wrapping ErrInvalidArgument; nil if the
// envelope is usable. It checks that every field is positive and that the
// fields agree with each other:
//
//   - BlockBytes is a whole number of bytes per token (a multiple of
//     BlockTokens);
//   - a maximum-context request fits in the pool;
//   - the prefill chunk is no larger than the context;
//   - every running request can hold at least one block;
//   - a Layout, if set, has positive layers, pieces per layer and piece
//     size, and its pieces add up to BlockBytes.
func (e Envelope) Validate() error {
	var ee *EnvelopeError
	positive := func(field string, v int) bool {
		if v > 0 {
			return true
		}
		if ee == nil {
			ee = &EnvelopeError{}
		}
		ee.add(field, "must be positive, got %d", v)
		return false
	}
	bt := positive("BlockTokens", e.BlockTokens)
	bb := positive("BlockBytes", e.BlockBytes)
	pb := positive("PoolBlocks", e.PoolBlocks)
	mc := positive("MaxContextTokens", e.MaxContextTokens)
	mp := positive("MaxPrefillTokens", e.MaxPrefillTokens)
	mr := positive("MaxRunningRequests", e.MaxRunningRequests)
	fail := func(field, format string, args ...any) {
		if ee == nil {
			ee = &EnvelopeError{}
		}
		ee.add(field, format, args...)
	}
	if bt && bb && e.BlockBytes%e.BlockTokens != 0 {
		fail("BlockBytes", "%d bytes is not a whole number of bytes per token for %d tokens per block", e.BlockBytes, e.BlockTokens)
	}
	if bt && pb && mc {
		if need := blocksFor(e.MaxContextTokens, e.BlockTokens); need > e.PoolBlocks {
			fail("MaxContextTokens", "a %d-token request needs %d blocks of %d tokens, the pool has %d (PoolBlocks)",
				e.MaxContextTokens, need, e.BlockTokens, e.PoolBlocks)
		}
	}
	if mc && mp && e.MaxPrefillTokens > e.MaxContextTokens {
		fail("MaxPrefillTokens", "prefill chunk of %d tokens exceeds the context limit of %d (MaxContextTokens)",
			e.MaxPrefillTokens, e.MaxContextTokens)
	}
	if pb && mr && e.MaxRunningRequests > e.PoolBlocks {
		fail("MaxRunningRequests", "%d running requests need at least one block each, the pool has %d (PoolBlocks)",
			e.MaxRunningRequests, e.PoolBlocks)
	}
	if e.HasLayout() {
		l := e.Layout
		switch {
		case l.Layers <= 0 || l.KVs <= 0 || l.PieceBytes <= 0:
			fail("Layout", "%d layers × %d pieces of %d bytes: all must be positive", l.Layers, l.KVs, l.PieceBytes)
		case bb && l.BlockBytes() != e.BlockBytes:
			fail("Layout", "%d layers × %d pieces of %d bytes make %d-byte blocks, BlockBytes is %d",
				l.Layers, l.KVs, l.PieceBytes, l.BlockBytes(), e.BlockBytes)
		}
	}
	return ee.err()
}

// HasLayout reports whether the envelope names a per-layer layout.
func (e Envelope) HasLayout() bool { return e.Layout != layout.Layout{} }

// BlocksFor returns the number of blocks that hold tokens tokens:
// ceil(tokens / BlockTokens). It returns 0 for tokens ≤ 0 and panics if
// BlockTokens is not positive (a programmer error: validate the envelope
// first).
func (e Envelope) BlocksFor(tokens int) int {
	if e.BlockTokens <= 0 {
		panic(fmt.Sprintf("kvlease: Envelope.BlocksFor with BlockTokens %d", e.BlockTokens))
	}
	if tokens <= 0 {
		return 0
	}
	return blocksFor(tokens, e.BlockTokens)
}

// PrefillSteps returns the number of scheduler steps a prompt of prompt
// tokens takes to prefill: ceil(prompt / MaxPrefillTokens). It returns 0
// for prompt ≤ 0 and panics if MaxPrefillTokens is not positive.
func (e Envelope) PrefillSteps(prompt int) int {
	if e.MaxPrefillTokens <= 0 {
		panic(fmt.Sprintf("kvlease: Envelope.PrefillSteps with MaxPrefillTokens %d", e.MaxPrefillTokens))
	}
	if prompt <= 0 {
		return 0
	}
	return blocksFor(prompt, e.MaxPrefillTokens)
}

// CheckRequest answers whether a request with a prompt of prompt tokens
// that may generate up to maxNew tokens fits the envelope. It touches no
// block and no transfer: call it before acquiring anything (then
// kvlease.Pool.Admit admits the request's sequence). The answer is nil,
// or an error wrapping
//
//   - ErrInvalidArgument: prompt < 1, maxNew < 0, or the envelope itself
//     is invalid (the *EnvelopeError is wrapped too);
//   - ErrExceedsCapacity: prompt + maxNew exceeds MaxContextTokens. Such a
//     request can never run under this envelope; retrying will not help.
func (e Envelope) CheckRequest(prompt, maxNew int) error {
	if err := e.Validate(); err != nil {
		return fmt.Errorf("kvlease: check request: %w", err)
	}
	if prompt < 1 {
		return fmt.Errorf("kvlease: check request: prompt of %d tokens: %w", prompt, kvlease.ErrInvalidArgument)
	}
	if maxNew < 0 {
		return fmt.Errorf("kvlease: check request: %d new tokens: %w", maxNew, kvlease.ErrInvalidArgument)
	}
	if prompt > e.MaxContextTokens || maxNew > e.MaxContextTokens-prompt {
		return fmt.Errorf("kvlease: check request: prompt %d + %d new tokens exceeds the context limit of %d tokens: %w",
			prompt, maxNew, e.MaxContextTokens, kvlease.ErrExceedsCapacity)
	}
	return nil
}

// A NamedEnvelope is the envelope one component runs with, named for the
// reports of AgreeEnvelopes ("frontend", "scheduler", "decode-pool").
type NamedEnvelope struct {
	Name     string
	Envelope Envelope
}

// envelopeFields are the fields AgreeEnvelopes compares, in field order.
// PoolBlocks is not among them: each pool has its own size, and Validate
// checks each against the shared limits.
var envelopeFields = [...]struct {
	name string
	get  func(Envelope) int
}{
	{"BlockTokens", func(e Envelope) int { return e.BlockTokens }},
	{"BlockBytes", func(e Envelope) int { return e.BlockBytes }},
	{"MaxContextTokens", func(e Envelope) int { return e.MaxContextTokens }},
	{"MaxPrefillTokens", func(e Envelope) int { return e.MaxPrefillTokens }},
	{"MaxRunningRequests", func(e Envelope) int { return e.MaxRunningRequests }},
}

// AgreeEnvelopes checks that the envelopes of several components agree,
// and that each is valid. It reports, as one *EnvelopeError wrapping
// ErrInvalidArgument, every field whose value differs between components
// (listing each component's value) and every problem Validate finds in a
// component's envelope (prefixed with the component's name). Every field
// must be equal except PoolBlocks: pools may differ in size, but each must
// hold a maximum-context request and every running request. Of the
// Layout, only the geometry must be equal (layers, pieces per layer,
// piece size, Tag): strides and block counts are each pool's own.
//
// At least one component is needed, and names must be non-empty and
// distinct (ErrInvalidArgument otherwise).
func AgreeEnvelopes(components ...NamedEnvelope) error {
	if len(components) == 0 {
		return fmt.Errorf("kvlease: agree envelopes: no component: %w", kvlease.ErrInvalidArgument)
	}
	ee := &EnvelopeError{}
	seen := make(map[string]bool, len(components))
	for _, c := range components {
		if c.Name == "" {
			ee.add("Name", "a component has no name")
		} else if seen[c.Name] {
			ee.add("Name", "component %q appears twice", c.Name)
		}
		seen[c.Name] = true
	}
	for _, f := range envelopeFields {
		first := f.get(components[0].Envelope)
		differ := false
		for _, c := range components[1:] {
			if f.get(c.Envelope) != first {
				differ = true
				break
			}
		}
		if !differ {
			continue
		}
		var b strings.Builder
		b.WriteString("components disagree:")
		for _, c := range components {
			fmt.Fprintf(&b, " %s=%d", c.Name, f.get(c.Envelope))
		}
		ee.add(f.name, "%s", b.String())
	}
	layoutsDiffer := false
	for _, c := range components[1:] {
		if !sameGeometry(c.Envelope, components[0].Envelope) {
			layoutsDiffer = true
			break
		}
	}
	if layoutsDiffer {
		var b strings.Builder
		b.WriteString("components disagree:")
		for _, c := range components {
			fmt.Fprintf(&b, " %s=%s", c.Name, geometry(c.Envelope))
		}
		ee.add("Layout", "%s", b.String())
	}
	for _, c := range components {
		var ce *EnvelopeError
		if err := c.Envelope.Validate(); err != nil {
			ce = err.(*EnvelopeError)
		}
		if ce == nil {
			continue
		}
		for _, p := range ce.Problems {
			ee.add(p.Field, "%s: %s", c.Name, p.Detail)
		}
	}
	return ee.err()
}

// Fingerprint returns a hash of what AgreeEnvelopes compares: every
// field but PoolBlocks, and of the Layout only its geometry
// (layout.Layout.Fingerprint). Two processes whose envelopes agree have
// equal fingerprints; a destination refuses a proposal whose fingerprint
// differs from its own, so a layout mismatch is refused at propose time.
// An envelope without a Layout has the fingerprint it had before layouts
// existed.
func (e Envelope) Fingerprint() uint64 {
	var b [8*len(envelopeFields) + 8]byte
	for i, f := range envelopeFields {
		binary.LittleEndian.PutUint64(b[8*i:], uint64(f.get(e)))
	}
	if !e.HasLayout() {
		return xxhash.Sum64(b[:8*len(envelopeFields)])
	}
	binary.LittleEndian.PutUint64(b[8*len(envelopeFields):], e.Layout.Fingerprint())
	return xxhash.Sum64(b[:])
}
