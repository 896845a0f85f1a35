package handoff_test

import (
	"errors"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/layout"
)

// 4 layers × K,V × 16-byte pieces: 128-byte blocks.
const (
	lyLayers = 4
	lyPiece  = 16
	lyBlocks = 32
	lyBytes  = lyLayers * 2 * lyPiece
)

func layoutEnvelope(l layout.Layout) handoff.Envelope {
	return handoff.Envelope{BlockTokens: 16, BlockBytes: lyBytes, PoolBlocks: lyBlocks,
		MaxContextTokens: 256, MaxPrefillTokens: 128, MaxRunningRequests: 8, Layout: l}
}

func layeredPool(t *testing.T, l layout.Layout) *kvlease.Pool[layout.Block] {
	t.Helper()
	h, err := layout.NewHost(l)
	if err != nil {
		t.Fatal(err)
	}
	p, err := kvlease.NewPool[layout.Block](h)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestEnvelopeLayoutValidateAndAgree(t *testing.T) {
	sep := layout.LayerSeparated(lyLayers, 2, lyBlocks, lyPiece, "bf16")
	con := layout.Contiguous(lyLayers, 2, 8, lyPiece, "bf16") // other strides, other block count
	if err := layoutEnvelope(sep).Validate(); err != nil {
		t.Fatal(err)
	}
	// Strides and block counts are each pool's own: the fingerprints agree.
	if a, b := layoutEnvelope(sep).Fingerprint(), layoutEnvelope(con).Fingerprint(); a != b {
		t.Fatalf("fingerprints differ for layouts that differ only in strides: %x %x", a, b)
	}
	if err := handoff.AgreeEnvelopes(
		handoff.NamedEnvelope{Name: "prefill", Envelope: layoutEnvelope(sep)},
		handoff.NamedEnvelope{Name: "decode", Envelope: layoutEnvelope(con)},
	); err != nil {
		t.Fatalf("agreeing layouts: %v", err)
	}
	// An envelope without a layout keeps the fingerprint it always had.
	plain := layoutEnvelope(layout.Layout{})
	if plain.Fingerprint() == layoutEnvelope(sep).Fingerprint() {
		t.Fatal("the layout does not change the fingerprint")
	}

	bad := layoutEnvelope(layout.LayerSeparated(lyLayers, 2, lyBlocks, 2*lyPiece, "bf16"))
	ps := problems(t, bad.Validate())
	if len(ps) != 1 || ps[0].Field != "Layout" || !strings.Contains(ps[0].Detail, "256-byte blocks, BlockBytes is 128") {
		t.Fatalf("Validate of a layout that does not make BlockBytes: %v", ps)
	}
	zero := layoutEnvelope(layout.Layout{Tag: "x"})
	if ps := problems(t, zero.Validate()); len(ps) != 1 || ps[0].Field != "Layout" {
		t.Fatalf("Validate of a layout with no layers: %v", ps)
	}

	half := layout.LayerSeparated(lyLayers/2, 2, lyBlocks, 2*lyPiece, "bf16") // same block bytes
	err := handoff.AgreeEnvelopes(
		handoff.NamedEnvelope{Name: "prefill", Envelope: layoutEnvelope(sep)},
		handoff.NamedEnvelope{Name: "decode", Envelope: layoutEnvelope(half)},
		handoff.NamedEnvelope{Name: "front", Envelope: plain},
	)
	ps = problems(t, err)
	if len(ps) != 1 || ps[0].Field != "Layout" ||
		ps[0].Detail != "components disagree: prefill=4×2×16B(bf16) decode=2×2×32B(bf16) front=none" {
		t.Fatalf("AgreeEnvelopes of differing layouts: %v", ps)
	}
}

func TestProposeRefusesLayoutMismatch(t *testing.T) {
	sep := layout.LayerSeparated(lyLayers, 2, lyBlocks, lyPiece, "bf16")
	con := layout.Contiguous(lyLayers, 2, lyBlocks, lyPiece, "bf16")
	half := layout.LayerSeparated(lyLayers/2, 2, lyBlocks, 2*lyPiece, "bf16")
	fp8 := layout.LayerSeparated(lyLayers, 2, lyBlocks, lyPiece, "fp8")
	hostPool := func() *kvlease.Pool[[]byte] {
		mem, err := kvlease.NewHostMemory(lyBlocks, lyBytes)
		if err != nil {
			t.Fatal(err)
		}
		p, err := kvlease.NewPool[[]byte](mem)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}

	for _, tt := range []struct {
		name     string
		src, dst *layout.Layout // nil: opaque host memory
		env      layout.Layout
		want     string // "" = accepted
	}{
		{"same geometry, other strides", &sep, &con, sep, ""},
		{"layered source, opaque destination", &sep, nil, sep, ""},
		{"layers differ", &sep, &half, sep, "source layout 4×2×16B(bf16), destination layout 2×2×32B(bf16): layout: 4 layers vs 2"},
		{"tags differ", &sep, &fp8, sep, `tag "bf16" vs "fp8"`},
		{"envelope names none", &sep, &con, layout.Layout{}, "source pool is in a per-layer layout (4×2×16B(bf16)) the envelope does not name"},
		{"destination differs from envelope", nil, &half, sep, "destination pool's layout 2×2×32B(bf16) disagrees with the envelope's 4×2×16B(bf16)"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := handoff.Config{Envelope: layoutEnvelope(tt.env)}
			var err error
			var src *kvlease.Lease[layout.Block]
			var srcPlain *kvlease.Lease[[]byte]
			switch {
			case tt.src != nil && tt.dst != nil:
				sp, dp := layeredPool(t, *tt.src), layeredPool(t, *tt.dst)
				src, _ = sp.Acquire("req", 2)
				var h *handoff.Handoff[layout.Block, layout.Block]
				h, err = handoff.Propose(src, dp, cfg)
				if err == nil && h.State() != handoff.Proposed {
					t.Fatalf("state %v", h.State())
				}
				if st := dp.Stats(); st.Leased != 0 {
					t.Fatalf("destination holds blocks after Propose: %+v", st)
				}
			case tt.src != nil:
				src, _ = layeredPool(t, *tt.src).Acquire("req", 2)
				_, err = handoff.Propose(src, hostPool(), cfg)
			default:
				srcPlain, _ = hostPool().Acquire("req", 2)
				_, err = handoff.Propose(srcPlain, layeredPool(t, *tt.dst), cfg)
			}
			if tt.want == "" {
				if err != nil {
					t.Fatalf("Propose: %v", err)
				}
				return
			}
			if !errors.Is(err, kvlease.ErrInvalidArgument) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Propose = %v, want ErrInvalidArgument mentioning %q", err, tt.want)
			}
		})
	}
}

// nopPlanes is a data plane that must never be reached: a refused
// proposal touches no plane.
type nopPlanes struct{ prepares, sends atomic.Int32 }

func (p *nopPlanes) Prepare(handoff.PlaneID, int) ([]byte, error) {
	p.prepares.Add(1)
	return nil, nil
}
func (p *nopPlanes) Receive(_ handoff.PlaneID, _ []layout.Block, _ []byte, attach func(*kvlease.Transfer) error) error {
	t := kvlease.NewTransfer(nil)
	if err := attach(t); err != nil {
		t.Resolve(err)
		return err
	}
	t.Resolve(nil)
	return nil
}
func (p *nopPlanes) Forget(handoff.PlaneID) {}
func (p *nopPlanes) Send(handoff.PlaneID, []layout.Block, []byte, func(*kvlease.Transfer) error) ([]byte, error) {
	p.sends.Add(1)
	return nil, errors.New("nopPlanes: send")
}
func (p *nopPlanes) Finish(handoff.PlaneID, error) {}

// The halves: a destination whose layout differs from the source's
// refuses the proposal at propose time (RejectEnvelope: the source sees
// ErrInvalidArgument and a reason naming the layouts), before it acquires
// anything or prepares its plane.
func TestHalvesRefuseLayoutMismatch(t *testing.T) {
	sep := layout.LayerSeparated(lyLayers, 2, lyBlocks, lyPiece, "bf16")
	half := layout.LayerSeparated(lyLayers/2, 2, lyBlocks, 2*lyPiece, "bf16")

	for _, tt := range []struct {
		name           string
		srcEnv, dstEnv layout.Layout
		dstMem         layout.Layout
		want           string
	}{
		{"layers differ", sep, half, half, "the envelopes or the block layouts differ (ours: 16-token blocks of 128 bytes, layout 2×2×32B(bf16)"},
		{"source names none", layout.Layout{}, sep, sep, "the source names no block layout, ours is 4×2×16B(bf16)"},
		{"agree", sep, sep, sep, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dstPool := layeredPool(t, tt.dstMem)
			planes := &nopPlanes{}
			dst, err := handoff.NewDestination[layout.Block](dstPool, planes, handoff.DestinationConfig[layout.Block]{
				HalfConfig: handoff.HalfConfig{Envelope: layoutEnvelope(tt.dstEnv), Deadline: 5 * time.Second, Insecure: true, Logf: quiet},
			})
			if err != nil {
				t.Fatal(err)
			}
			a, b := net.Pipe()
			served := make(chan error, 1)
			go func() { served <- dst.Serve(b) }()
			// The source's pool is opaque host memory with 128-byte
			// blocks: its half checks nothing about a layout, so the
			// destination's check at propose time is what refuses.
			mem, err := kvlease.NewHostMemory(lyBlocks, lyBytes)
			if err != nil {
				t.Fatal(err)
			}
			srcPool, err := kvlease.NewPool[[]byte](mem)
			if err != nil {
				t.Fatal(err)
			}
			src, err := handoff.NewSource[[]byte](a, &bytePlane{}, handoff.HalfConfig{Envelope: layoutEnvelope(tt.srcEnv), Deadline: 5 * time.Second, Insecure: true, Logf: quiet})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				_ = src.Close()
				<-served
			})
			l, err := srcPool.Acquire("req", 2)
			if err != nil {
				t.Fatal(err)
			}
			o, err := src.Propose(1, "req", l, nil)
			if err != nil {
				t.Fatal(err)
			}
			st := o.Wait(5 * time.Second)
			if tt.want == "" {
				// The stub source plane refuses to send, so the handoff
				// fails after the accept; what matters is that it was
				// accepted.
				if st == handoff.Rejected || !st.Final() {
					t.Fatalf("state %v (%v), want accepted and then final", st, o.Err())
				}
				if planes.prepares.Load() != 1 {
					t.Fatalf("%d prepares for an agreeing proposal", planes.prepares.Load())
				}
				return
			}
			if st != handoff.Rejected {
				t.Fatalf("state %v, want Rejected (%v)", st, o.Err())
			}
			if err := o.Err(); !errors.Is(err, kvlease.ErrInvalidArgument) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("source's error %v, want ErrInvalidArgument mentioning %q", err, tt.want)
			}
			if planes.prepares.Load() != 0 {
				t.Fatal("a refused proposal prepared the plane")
			}
			if st := dstPool.Stats(); st.Free != lyBlocks {
				t.Fatalf("destination pool after the refusal: %+v", st)
			}
		})
	}
}

// bytePlane is a source plane for []byte pools that is never reached in
// these tests.
type bytePlane struct{}

func (bytePlane) Send(handoff.PlaneID, [][]byte, []byte, func(*kvlease.Transfer) error) ([]byte, error) {
	return nil, errors.New("bytePlane: send")
}
func (bytePlane) Finish(handoff.PlaneID, error) {}

// The halves check their own pool's memory too: a destination pool in a
// layout its envelope does not name is refused by NewDestination, and a
// source lease whose pool's layout differs from the envelope by
// Source.Propose, before anything is sent.
// quiet drops the insecure sessions' log lines.
func quiet(string, ...any) {}

func TestHalvesCheckTheirPoolsLayout(t *testing.T) {
	sep := layout.LayerSeparated(lyLayers, 2, lyBlocks, lyPiece, "bf16")
	half := layout.LayerSeparated(lyLayers/2, 2, lyBlocks, 2*lyPiece, "bf16")
	_, err := handoff.NewDestination[layout.Block](layeredPool(t, sep), &nopPlanes{}, handoff.DestinationConfig[layout.Block]{
		HalfConfig: handoff.HalfConfig{Envelope: layoutEnvelope(layout.Layout{}), Insecure: true},
	})
	if !errors.Is(err, kvlease.ErrInvalidArgument) || !strings.Contains(err.Error(), "the envelope does not name") {
		t.Fatalf("NewDestination over an unnamed layout: %v", err)
	}

	a, b := net.Pipe()
	t.Cleanup(func() { _ = b.Close() })
	planes := &nopPlanes{}
	go func() { _ = handoff.AcceptInsecure(b, layoutEnvelope(sep)) }()
	src, err := handoff.NewSource[layout.Block](a, planes, handoff.HalfConfig{Envelope: layoutEnvelope(sep), Insecure: true, Logf: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = src.Close() })
	l, err := layeredPool(t, half).Acquire("req", 2)
	if err != nil {
		t.Fatal(err)
	}
	o, err := src.Propose(1, "req", l, nil)
	if o != nil || !errors.Is(err, kvlease.ErrInvalidArgument) || !strings.Contains(err.Error(), "source pool's layout 2×2×32B(bf16) disagrees") {
		t.Fatalf("Source.Propose of a lease in another layout: %v, %v", o, err)
	}
}
