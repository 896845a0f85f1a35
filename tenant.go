package kvlease

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
)

// Tenant isolation.
//
// A prefix-cache hit is fast, so a request can tell by timing whether
// another request's prefix is cached (the prefix-cache timing attack
// reaches ROC AUC 0.99 at 8-token prefixes). vLLM's cache_salt is a
// request field: anyone who learns a salt can copy it and get the signal
// back. Here the chain's root is derived inside the pool from a secret it
// holds per tenant: a request of one tenant can never hit, or time,
// another tenant's blocks, whatever salt it carries, while requests of the
// same tenant share blocks as before.
//
// The engine authenticates the tenant (an API key, an mTLS identity) and
// asks TenantSeed for the seed of that tenant's namespace; it never takes
// a seed from the request itself.

// minTenantKey is the shortest key WithTenantKey accepts: 128 bits.
const minTenantKey = 16

// WithTenantKey gives the pool the key every tenant's secret is derived
// from (HMAC-SHA256(key, "kvlease tenant\x00" ‖ tenant)), enabling
// TenantSeed. key must be at least 16 bytes of secret randomness (32 from
// crypto/rand is right) and stay in the process; the pool keeps its own
// copy. Two keys conflict.
func WithTenantKey(key []byte) Option {
	k := append([]byte(nil), key...)
	return newOption(fmt.Sprintf("WithTenantKey(%d bytes)", len(key)), func(c *config) error {
		if len(k) < minTenantKey {
			return fmt.Errorf("kvlease: tenant key of %d bytes, want at least %d: %w", len(k), minTenantKey, ErrInvalidArgument)
		}
		if err := c.claim("tenant key", hmac.Equal(c.tenantKey, k)); err != nil {
			return err
		}
		c.tenantKey = k
		return nil
	})
}

// TenantSeed returns the seed of tenant's namespace for a public salt (a
// model, an adapter, a cache_salt): HMAC-SHA256 under the tenant's secret
// of the salt's 8 little-endian bytes, its first 8 bytes read little-endian.
// Pass it where a seed goes (Admit, AcquirePrefixTokens,
// ChainHashes). The same tenant and salt always give the same seed;
// another tenant with the same salt gets an unrelated one, so its
// prompts never hit this tenant's blocks. It needs WithTenantKey and a
// non-empty tenant; otherwise the error wraps ErrInvalidArgument. It
// costs two HMAC-SHA256 computations (about a microsecond): call it once
// per request.
func (p *Pool[R]) TenantSeed(tenant string, salt BlockHash) (BlockHash, error) {
	key := p.cfg.tenantKey
	if key == nil || tenant == "" {
		return 0, fmt.Errorf("kvlease: tenant seed for %q needs WithTenantKey and a tenant: %w", tenant, ErrInvalidArgument)
	}
	secret := tenantSecret(key, tenant)
	m := hmac.New(sha256.New, secret[:])
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(salt))
	m.Write(b[:])
	var out [sha256.Size]byte
	m.Sum(out[:0])
	return BlockHash(binary.LittleEndian.Uint64(out[:8])), nil
}

// tenantSecret is tenant's secret under the pool's tenant key: the root
// its seeds (TenantSeed) and its public namespace are derived from.
func tenantSecret(key []byte, tenant string) [sha256.Size]byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("kvlease tenant\x00"))
	m.Write([]byte(tenant))
	var secret [sha256.Size]byte
	m.Sum(secret[:0])
	return secret
}

// Namespaces on the wire.
//
// A router that keys blocks by their tokens (llm-d's indexer recomputes
// its keys from token_ids) cannot see the seed that keeps two tenants'
// identical prompts apart in the pool. So every block a registered
// tenant seals carries the tenant's public namespace identifier
// (Tenant.Namespace): in its KVEvent (Namespace), in its seal record
// (SealInfo.Namespace, which the tiers and handoffs carry to every copy)
// and, through the events package, on the wire as the last extra key of
// each chain's first block, where vLLM puts its cache_salt.
//
// The identifier is "ns:" and 32 hex digits of an HMAC under the
// tenant's secret (WithTenantKey): stable for a tenant across every pool
// that shares the key, unrelated between tenants, and revealing neither
// the key, the tenant's secret, its seeds nor its name. With
// WithPublicTenantNames it is the tenant's name instead. A pool with
// neither gives tenants no namespace: their events are as a plain
// pool's.

// namespacePrefix starts every derived namespace identifier.
const namespacePrefix = "ns:"

// tenantNamespace is the public namespace identifier of tenant in a
// pool configured with cfg ("" for none).
func tenantNamespace(cfg *config, tenant string) string {
	if cfg.publicNames {
		return tenant
	}
	if cfg.tenantKey == nil {
		return ""
	}
	secret := tenantSecret(cfg.tenantKey, tenant)
	m := hmac.New(sha256.New, secret[:])
	m.Write([]byte("kvlease namespace\x00"))
	var out [sha256.Size]byte
	m.Sum(out[:0])
	return namespacePrefix + hex.EncodeToString(out[:16])
}

// WithPublicTenantNames makes each registered tenant's namespace
// identifier (Tenant.Namespace, published with its blocks' KV events)
// its name rather than an HMAC of its secret: for a router that is
// configured with tenant names, where the names are not secret. Without
// it a tenant's name never leaves the pool.
func WithPublicTenantNames() Option {
	return newOption("WithPublicTenantNames()", func(c *config) error {
		c.publicNames = true
		return nil
	})
}

// Namespace returns the tenant's public namespace identifier, which its
// blocks' KV events, seal records and copies carry (see the package's
// Namespaces section): "ns:" and 32 hex digits derived from its secret
// with WithTenantKey, its name with WithPublicTenantNames, "" with
// neither. A router that keys blocks by their tokens adds it as the last
// extra key of a prompt's first block.
func (t *Tenant[R]) Namespace() string { return t.ns }
