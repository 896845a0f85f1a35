package tiers

import (
	"github.com/kvlease/kvlease/events"
)

// EventSources returns a KV event source for each tier whose pool was
// created with kvlease.WithKVEvents (the disk tier's through
// DiskConfig.PoolOptions), each with its tier's medium: "GPU" for the
// device, "CPU" for the host, "DISK" for the disk, as vLLM names them.
// Hand them to one events.Publisher:
//
//	pub, err := events.NewPublisher(cfg, cache.EventSources()...)
//
// A router then learns which tier holds each block: the device pool
// reports a block removed when it is evicted (offered down or lost), the
// host pool reports it stored once its copy is sealed there, and so on
// down. The lower tiers' stored events carry the parent and tokens of the
// device's original, read from the device pool's seal record (see the
// package's Seal records section), when it was sealed with SealTokens
// (give the lower pools kvlease.WithBlockTokens too); blocks sealed with
// Seal name their parent but carry no tokens, and the publisher leaves
// such events out.
func (c *Cache[D]) EventSources() []events.Source {
	var out []events.Source
	add := func(p events.KVEventSource, t Tier) {
		if p.KVEventsReady() != nil {
			out = append(out, events.Source{Pool: p, Medium: t.Medium()})
		}
	}
	add(c.dev, TierDevice)
	add(c.host, TierHost)
	if c.disk != nil {
		add(c.disk.pool, TierDisk)
	}
	return out
}
