package handoff_test

import (
	"errors"
	"fmt"
	"net"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// A decode worker serves two prefill fleets, each under its own key.
// Each identity's caps hold across all its sessions: by default it may
// hold half the pool in handoffs not yet final; IdentityLimits gives
// the batch fleet less, and one session at a time. A second session of
// the batch fleet is refused at the end of its handshake (ErrLimit).
func ExampleLimits() {
	env := handoff.Envelope{BlockTokens: 16, BlockBytes: 64, PoolBlocks: 16,
		MaxContextTokens: 256, MaxPrefillTokens: 256, MaxRunningRequests: 4}
	mem, _ := kvlease.NewHostMemory(16, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	interactive, _ := handoff.GenerateKey()
	batch, _ := handoff.GenerateKey()

	dst, _ := handoff.NewDestination(pool, nopPlane{}, handoff.DestinationConfig[[]byte]{
		HalfConfig: handoff.HalfConfig{Envelope: env, Auth: &handoff.PSK{
			Keys: map[string][]byte{"interactive": interactive, "batch": batch}}},
		IdentityLimits: func(identity string) handoff.Limits {
			if identity == "psk:batch" {
				return handoff.Limits{Blocks: 4, Sessions: 1}
			}
			return handoff.Limits{} // the defaults: MaxSessionBlocks (half the pool), ...
		},
	})
	session := func(id string, key []byte) error {
		a, b := net.Pipe()
		go func() { _ = dst.Serve(b) }()
		_, err := handoff.NewSource(a, nopSender{}, handoff.HalfConfig{Envelope: env,
			Auth: &handoff.PSK{ID: id, Key: key}})
		return err
	}
	fmt.Println("batch, first session:", session("batch", batch))
	err := session("batch", batch)
	fmt.Println("batch, second session refused:", errors.Is(err, handoff.ErrLimit))
	fmt.Println("interactive:", session("interactive", interactive))
	// Output:
	// batch, first session: <nil>
	// batch, second session refused: true
	// interactive: <nil>
}
