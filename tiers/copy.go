package tiers

import (
	"fmt"
	"sync/atomic"

	"github.com/kvlease/kvlease"
)

// MemCopy is a kvlease.Transport between two Go-memory tiers (a CPU
// "device" pool over kvlease.HostMemory and a host pool): each Start
// copies its pairs on a goroutine of its own and resolves the transfer
// when that goroutine is done. Cancel skips the pairs not yet copied.
// With a GPU, use the gpu package's CopyEngine transports instead.
type MemCopy struct{}

var _ kvlease.Transport[[]byte, []byte] = MemCopy{}

// Start implements kvlease.Transport.
func (MemCopy) Start(pairs []kvlease.CopyPair[[]byte, []byte], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	if len(pairs) == 0 || attach == nil {
		return nil, fmt.Errorf("tiers: copy of %d pairs: %w", len(pairs), kvlease.ErrInvalidArgument)
	}
	for _, p := range pairs {
		if len(p.Src) != len(p.Dst) {
			return nil, fmt.Errorf("tiers: copy of %d bytes into %d: %w", len(p.Src), len(p.Dst), kvlease.ErrInvalidArgument)
		}
	}
	var canceled atomic.Bool
	t := kvlease.NewTransfer(func() { canceled.Store(true) })
	if err := attach(t); err != nil {
		t.Resolve(err)
		return t, err
	}
	go func() {
		for i, p := range pairs {
			if canceled.Load() {
				t.Resolve(fmt.Errorf("tiers: copy canceled after %d of %d blocks: %w", i, len(pairs), ErrCanceled))
				return
			}
			copy(p.Dst, p.Src)
		}
		t.Resolve(nil)
	}()
	return t, nil
}
