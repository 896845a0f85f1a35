package kvlease

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Options that disagree are refused, naming both.
func TestConflictingOptionsRefused(t *testing.T) {
	mem := must(NewHostMemory(4, 8))
	obs := ObserverFunc(func(Event) {})
	for _, tc := range []struct {
		opts       []Option
		names      []string
		conflicted bool
	}{
		{[]Option{WithBlockTokens(16), WithVerifiedPrefix(32)}, []string{"WithBlockTokens(16)", "WithVerifiedPrefix(32)"}, true},
		{[]Option{WithVerifiedPrefix(32), WithBlockTokens(16)}, []string{"WithVerifiedPrefix(32)", "WithBlockTokens(16)"}, true},
		{[]Option{WithBlockTokens(16), WithBlockTokens(8)}, []string{"WithBlockTokens(16)", "WithBlockTokens(8)"}, true},
		{[]Option{WithDrainDeadline(time.Second), WithDrainDeadline(time.Minute)}, []string{"WithDrainDeadline(1s)", "WithDrainDeadline(1m0s)"}, true},
		{[]Option{WithLeakCheck(true), WithLeakCheck(false)}, []string{"WithLeakCheck(true)", "WithLeakCheck(false)"}, true},
		{[]Option{WithKVEvents(8), WithKVEvents(16)}, []string{"WithKVEvents(8)", "WithKVEvents(16)"}, true},
		{[]Option{WithQuarantineAlert(0.1), WithQuarantineAlert(0.2)}, []string{"WithQuarantineAlert(0.1)", "WithQuarantineAlert(0.2)"}, true},
		{[]Option{WithObserver(obs), WithObserver(obs)}, []string{"WithObserver", "WithObserver"}, true},
		// Agreeing or empty options are fine.
		{[]Option{WithBlockTokens(16), WithVerifiedPrefix(16)}, nil, false},
		{[]Option{WithBlockTokens(16), WithBlockTokens(16), {}, WithObserver(nil), WithObserver(obs)}, nil, false},
		{[]Option{WithLeakCheck(false), WithLeakCheck(false)}, nil, false},
	} {
		p, err := NewPool[[]byte](mem, tc.opts...)
		if !tc.conflicted {
			require.NoError(t, err, "%v", tc.opts)
			continue
		}
		require.Nil(t, p)
		require.ErrorIs(t, err, ErrInvalidArgument, "%v", tc.opts)
		for _, n := range tc.names {
			require.Contains(t, err.Error(), n)
		}
	}
	p, err := NewPool[[]byte](mem, WithBlockTokens(16), WithVerifiedPrefix(16))
	require.NoError(t, err)
	require.Equal(t, 16, p.cfg.blockTokens)
	require.True(t, p.cfg.verify)
	require.Equal(t, "WithBlockTokens(16)", WithBlockTokens(16).string())
	require.Equal(t, "Option{}", Option{}.string())
}

// Sizes on the public API never overflow into a panic or a retryable
// error.
func TestOptionSizesBounded(t *testing.T) {
	mem := must(NewHostMemory(4, 8))
	_, err := NewPool[[]byte](mem, WithKVEvents(1<<62))
	require.ErrorIs(t, err, ErrInvalidArgument, "a ring that size cannot be allocated")
	for _, share := range []float64{-0.1, 1, 2, math.NaN()} {
		_, err = NewPool[[]byte](mem, WithQuarantineAlert(share))
		require.ErrorIs(t, err, ErrInvalidArgument, "share %v", share)
	}
}
