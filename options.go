package kvlease

import (
	"fmt"
	"time"

	"github.com/kvlease/kvlease/internal/invariants"
)

// Option configures a Pool at construction.
type Option func(*config) error

type config struct {
	obs         Observer
	deadline    time.Duration
	leakCheck   bool
	verify      bool
	blockTokens int
	kvEvents    int
}

func defaultConfig() config {
	return config{leakCheck: invariants.Enabled}
}

// WithObserver sets the observer that sees every lifecycle transition of
// the pool and of the leases and transfers it gates. A nil observer is
// allowed and means none.
func WithObserver(o Observer) Option {
	return func(c *config) error { c.obs = o; return nil }
}

// WithDrainDeadline sets how long a closed lease may stay unsettled. When
// the deadline passes, the pool reports it (EventDeadline) and quarantines
// the lease's still-pending transfers with reason ErrDrainDeadline: their
// blocks are counted as Quarantined and never reused. Time is never
// evidence, so nothing is freed; a late Resolve lifts the quarantine.
// Quarantining acts on the transfer, so every other lease it gates (the
// other side of a copy) is quarantined too: the transfer failed to prove
// quiescence in time for anyone. d must be positive; the default is no
// deadline.
func WithDrainDeadline(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("kvlease: drain deadline %v must be positive: %w", d, ErrInvalidArgument)
		}
		c.deadline = d
		return nil
	}
}

// WithLeakCheck turns the leak check on or off. When on, every lease gets a
// runtime cleanup (one extra allocation) that reports EventLeaked to the
// observer if the lease becomes unreachable while still open. It is on by
// default in checked builds (-race or -tags invariants) and off otherwise.
// A leaked lease's blocks are never reclaimed: they stay leased.
func WithLeakCheck(on bool) Option {
	return func(c *config) error { c.leakCheck = on; return nil }
}
