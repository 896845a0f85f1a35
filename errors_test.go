package kvlease

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestExhaustedErrorsReadWell(t *testing.T) {
	p := newTestPool(t, 3)
	l, err := p.Acquire("a", 2)
	require.NoError(t, err)
	hold, err := p.Acquire("hold", 1)
	require.NoError(t, err)
	defer hold.Release()
	_, err = p.Acquire("b", 1)
	require.ErrorIs(t, err, ErrExhausted)
	require.Equal(t, `kvlease: acquire 1 blocks for "b": 0 free or evictable: kvlease: exhausted`, err.Error())
	err = l.Extend(1)
	require.ErrorIs(t, err, ErrExhausted)
	require.Contains(t, err.Error(), "extend lease")
	_, _, err = p.AcquirePrefix("c", []BlockHash{1}, 1)
	require.ErrorIs(t, err, ErrExhausted)
	l.Release()
}
