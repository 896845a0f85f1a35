package replay

import (
	"github.com/kvlease/kvlease"
)

// Tenants is a kvlease pool shared by tenants, as an Allocator: each
// request's lease is acquired as the tenant Of names for its owner (the
// engine names a request "req-<trace id>"), or as no tenant when Of
// returns nil. The flood benchmark (bench/flood_test.go) replays two
// tenants' traces through one.
type Tenants struct {
	*KVLease
	Of func(owner string) *kvlease.Tenant[[]byte]
}

// NewTenants makes a pool of blocks blocks of blockBytes bytes, as
// NewKVLease does, for tenants; register them with t.Pool.Tenant and set
// Of.
func NewTenants(blocks, blockBytes int) (*Tenants, error) {
	a, err := NewKVLease(blocks, blockBytes)
	if err != nil {
		return nil, err
	}
	a.name = "kvlease-tenants"
	return &Tenants{KVLease: a}, nil
}

// AcquirePrefix is Tenant.AcquirePrefix for the owner's tenant
// (Pool.AcquirePrefix for none).
func (a *Tenants) AcquirePrefix(owner string, hashes []kvlease.BlockHash, n int) (Lease, int, error) {
	var t *kvlease.Tenant[[]byte]
	if a.Of != nil {
		t = a.Of(owner)
	}
	if t == nil {
		return a.KVLease.AcquirePrefix(owner, hashes, n)
	}
	l, hits, err := t.AcquirePrefix(owner, hashes, n)
	if err != nil {
		return nil, 0, err
	}
	return l, hits, nil
}
