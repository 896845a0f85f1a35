package handoff

import (
	"fmt"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/layout"
)

// Layouts and handoffs. A pool whose blocks are per-layer pieces (a
// layout.Layout: vLLM's [2, blocks, block_tokens, heads, dim] tensors)
// can only hand blocks to a pool whose pieces agree: the same layers,
// pieces per layer, piece size and element geometry. The envelope names
// that geometry (Envelope.Layout) and its Fingerprint covers it, so:
//
//   - the in-process Propose refuses a source or destination pool whose
//     memory describes a layout the envelope does not name, or whose
//     geometry differs from the envelope's (naming both sides' layouts
//     when both describe one);
//   - Source.Propose refuses a lease whose pool's layout disagrees with
//     its half's envelope, and NewDestination a pool that does;
//   - the destination refuses, at propose time, a proposal whose envelope
//     fingerprint differs from its own (RejectEnvelope, which the source
//     sees as ErrInvalidArgument): two processes whose layouts differ
//     have different fingerprints.
//
// Every such refusal wraps kvlease.ErrInvalidArgument and happens before
// anything is acquired or attached. A memory that describes no layout (a
// kvlease.HostMemory: opaque spans of BlockBytes) is taken to be in the
// envelope's layout, block-contiguous: it is checked by its BlockBytes
// alone.

// describesLayout is a memory that knows its layout (gpu.LayeredDevice,
// gpu.LayeredPinned, layout.Host).
type describesLayout interface{ Layout() layout.Layout }

// memoryLayout returns the layout mem describes, if any.
func memoryLayout(mem any) (layout.Layout, bool) {
	if d, ok := mem.(describesLayout); ok {
		return d.Layout(), true
	}
	return layout.Layout{}, false
}

// geometry describes the part of an envelope's layout that must agree.
func geometry(e Envelope) string {
	if !e.HasLayout() {
		return "none"
	}
	return geometryOf(e.Layout)
}

func geometryOf(l layout.Layout) string {
	return fmt.Sprintf("%d×%d×%dB(%s)", l.Layers, l.KVs, l.PieceBytes, l.Tag)
}

// sameGeometry reports whether two envelopes name the same layout
// geometry (or both none).
func sameGeometry(a, b Envelope) bool {
	if a.HasLayout() != b.HasLayout() {
		return false
	}
	return !a.HasLayout() || a.Layout.Compatible(b.Layout) == nil
}

// checkMemoryLayout checks the memory of one side's pool against the
// envelope: a memory that describes a layout needs the envelope to name a
// compatible one.
func checkMemoryLayout(side string, mem any, e Envelope) error {
	l, ok := memoryLayout(mem)
	if !ok {
		return nil
	}
	if !e.HasLayout() {
		return fmt.Errorf("kvlease: handoff: %s pool is in a per-layer layout (%s) the envelope does not name: set Envelope.Layout so both sides compare it: %w",
			side, geometryOf(l), kvlease.ErrInvalidArgument)
	}
	if err := e.Layout.Compatible(l); err != nil {
		return fmt.Errorf("kvlease: handoff: %s pool's layout %s disagrees with the envelope's %s: %w", side, geometryOf(l), geometryOf(e.Layout), err)
	}
	return nil
}

// checkLayouts checks both sides of an in-process handoff: when both
// memories describe a layout they are compared with each other first (the
// error names the first difference), then each against the envelope.
func checkLayouts(srcSide, dstSide string, src, dst any, e Envelope) error {
	sl, sok := memoryLayout(src)
	dl, dok := memoryLayout(dst)
	if sok && dok {
		if err := sl.Compatible(dl); err != nil {
			return fmt.Errorf("kvlease: handoff: %s layout %s, %s layout %s: %w", srcSide, geometryOf(sl), dstSide, geometryOf(dl), err)
		}
	}
	if err := checkMemoryLayout(srcSide, src, e); err != nil {
		return err
	}
	return checkMemoryLayout(dstSide, dst, e)
}

// envelopeMismatch is the destination's refusal of a proposal whose
// envelope fingerprint is not its own. The fingerprint covers the layout,
// so the reason names ours; when the proposal matches our envelope but
// for the layout, it says so.
func envelopeMismatch(id, theirs uint64, ours Envelope) error {
	bare := ours
	bare.Layout = layout.Layout{}
	var why string
	switch {
	case ours.HasLayout() && theirs == bare.Fingerprint():
		why = fmt.Sprintf("the source names no block layout, ours is %s", geometry(ours))
	default:
		why = fmt.Sprintf("the envelopes or the block layouts differ (ours: %d-token blocks of %d bytes, layout %s, context %d, prefill %d, %d running; compare them with AgreeEnvelopes)",
			ours.BlockTokens, ours.BlockBytes, geometry(ours), ours.MaxContextTokens, ours.MaxPrefillTokens, ours.MaxRunningRequests)
	}
	return fmt.Errorf("kvlease: handoff %d: envelope fingerprint %016x, ours %016x: %s: %w", id, theirs, ours.Fingerprint(), why, kvlease.ErrInvalidArgument)
}
