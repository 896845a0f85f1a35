package kvlease

import (
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestVerifiedModeCatchesCollision(t *testing.T) {
	const seed = BlockHash(11)
	victim := prompt(1, 16)
	attacker := prompt(2, 16)
	forged := HashBlock(seed, attacker) // the attacker's lookup hash

	for _, verified := range []bool{false, true} {
		t.Run(fmt.Sprintf("verified=%v", verified), func(t *testing.T) {
			opts := []Option{WithBlockTokens(16)}
			if verified {
				opts = []Option{WithVerifiedPrefix(16)}
			}
			p := newTestPool(t, 4, opts...)
			v, err := p.Acquire("victim", 1)
			require.NoError(t, err)
			r, _ := v.Region(0)
			copy(r, "victim's secret KV")
			// Inject a collision: the victim's block is findable by the
			// hash of the attacker's tokens.
			require.NoError(t, v.ls.seal(0, forged, &sealTokens{parent: seed, tokens: victim}))
			v.Release()

			// One more token: the forged block is not the one holding the
			// prompt's last token, so it may hit.
			l, hits, err := p.AcquirePrefixTokens("attacker", seed, append(slices.Clone(attacker), 7), 2)
			require.NoError(t, err)
			defer l.Release()
			if !verified {
				require.Equal(t, 1, hits, "plain mode trusts the hash: this is the danger")
				return
			}
			require.Equal(t, 0, hits, "verified mode turns the collision into a miss")
			require.EqualValues(t, 1, p.Stats().VerifyMismatches)
			got, _ := l.Region(0)
			require.NotContains(t, string(got), "secret")
		})
	}
}

func TestVerifiedModeRules(t *testing.T) {
	p := newTestPool(t, 8, WithVerifiedPrefix(4))
	toks := prompt(1, 12)
	a, err := p.Acquire("a", 3)
	require.NoError(t, err)
	require.ErrorIs(t, a.Seal(0, 1), ErrInvalidArgument, "verified mode needs the tokens")
	_, err = a.SealTokens(0, 0, toks[:3])
	require.ErrorIs(t, err, ErrInvalidArgument, "a block holds exactly 4 tokens")
	parent := BlockHash(9)
	for i := range 3 {
		parent, err = a.SealTokens(i, parent, toks[i*4:(i+1)*4])
		require.NoError(t, err)
	}
	a.Release()
	hs := ChainHashes(9, toks, 4)
	require.Equal(t, 0, p.CachedPrefix(hs), "hash-only lookups cannot be verified")
	require.Equal(t, 2, p.CachedPrefixTokens(9, toks), "never the block holding the last token")
	require.Equal(t, 3, p.CachedPrefixTokens(9, append(slices.Clone(toks), 1)))
	require.Equal(t, 0, p.CachedPrefixTokens(8, append(slices.Clone(toks), 1)), "another namespace")
	l, hits, err := p.AcquirePrefixTokens("b", 9, append(slices.Clone(toks), 1, 2), 4)
	require.NoError(t, err)
	require.Equal(t, 3, hits)
	l.Release()
	// A different middle block stops the match there.
	other := append(slices.Clone(toks), 1)
	other[5] = -5
	require.Equal(t, 1, p.CachedPrefixTokens(9, other))

	plain := newTestPool(t, 2)
	_, _, err = plain.AcquirePrefixTokens("x", 0, toks, 1)
	require.ErrorIs(t, err, ErrInvalidArgument, "no block size configured")
	_, err = NewPool[[]byte](must(NewHostMemory(1, 1)), WithVerifiedPrefix(0))
	require.ErrorIs(t, err, ErrInvalidArgument)
}
