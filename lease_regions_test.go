package kvlease

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestAppendRegionsAndAvailable(t *testing.T) {
	p := newTestPool(t, 6)
	require.Equal(t, 6, p.Available())
	l, err := p.Acquire("a", 3)
	require.NoError(t, err)
	require.Equal(t, 3, p.Available())
	rs, err := l.AppendRegions(nil, 1)
	require.NoError(t, err)
	require.Len(t, rs, 2)
	for i, r := range rs {
		want, _ := l.Region(i + 1)
		require.Equal(t, &want[0], &r[0], "region %d", i+1)
	}
	rs, err = l.AppendRegions(rs[:0], 3)
	require.NoError(t, err)
	require.Empty(t, rs)
	_, err = l.AppendRegions(nil, 4)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = l.AppendRegions(nil, -1)
	require.ErrorIs(t, err, ErrInvalidArgument)
	buf := make([][]byte, 0, 3)
	allocs := testing.AllocsPerRun(50, func() { buf, _ = l.AppendRegions(buf[:0], 0) })
	require.Zero(t, allocs)
	l.Release()
	_, err = l.AppendRegions(nil, 0)
	require.ErrorIs(t, err, ErrLeaseClosed)
	require.Equal(t, 6, p.Available())
}
