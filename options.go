package kvlease

import (
	"fmt"
	"math"
	"time"

	"github.com/kvlease/kvlease/internal/invariants"
)

// Option configures a Pool at construction. Make one with a With...
// function (WithObserver, WithDrainDeadline, WithBlockTokens, ...); the
// zero Option changes nothing. Options that disagree (two that set the
// same setting to different values, such as WithBlockTokens(16) with
// WithVerifiedPrefix(32)) make NewPool fail with ErrInvalidArgument,
// naming both: no option silently overrides another.
type Option struct {
	name  string // how errors name it, with its argument: "WithBlockTokens(16)"
	apply func(*config) error
}

// newOption returns an option called name (as errors show it) that
// applies f. Every With... function of the package is one.
func newOption(name string, f func(*config) error) Option {
	return Option{name: name, apply: f}
}

// string returns the option as written, with its argument.
func (o Option) string() string {
	if o.name == "" {
		return "Option{}"
	}
	return o.name
}

type config struct {
	obs          Observer
	deadline     time.Duration
	leakCheck    bool
	verify       bool
	sealRecords  bool // WithSealRecords
	blockTokens  int
	kvEvents     int
	tenantKey    []byte  // WithTenantKey: the root of every tenant's secret
	publicNames  bool    // WithPublicTenantNames: a tenant's namespace is its name
	hasher       Hasher  // WithHasher; nil: HashBlock
	alert        bool    // WithQuarantineAlert given
	alertShare   float64 // alert when quarantined blocks exceed this share
	setBy        map[string]string
	applyingName string // the option being applied
}

func defaultConfig() config {
	return config{leakCheck: invariants.Enabled}
}

// claim records that the option being applied sets setting. same says
// whether it sets it to the value it already has; a second option that
// sets it to another value is refused, naming both.
func (c *config) claim(setting string, same bool) error {
	if prev, ok := c.setBy[setting]; ok && !same {
		return fmt.Errorf("kvlease: options %s and %s conflict (both set the %s): %w",
			prev, c.applyingName, setting, ErrInvalidArgument)
	}
	if c.setBy == nil {
		c.setBy = make(map[string]string)
	}
	if _, ok := c.setBy[setting]; !ok {
		c.setBy[setting] = c.applyingName
	}
	return nil
}

// applyOptions applies opts in order to the default configuration.
func applyOptions(opts []Option) (config, error) {
	cfg := defaultConfig()
	for _, o := range opts {
		if o.apply == nil {
			continue
		}
		cfg.applyingName = o.string()
		if err := o.apply(&cfg); err != nil {
			return cfg, err
		}
	}
	cfg.applyingName, cfg.setBy = "", nil
	return cfg, nil
}

// WithObserver sets the observer that sees every lifecycle transition of
// the pool and of the leases and transfers it gates. A nil observer is
// allowed and means none. Two non-nil observers conflict: combine them
// into one yourself.
func WithObserver(o Observer) Option {
	return newOption("WithObserver", func(c *config) error {
		if o == nil {
			return nil
		}
		if err := c.claim("observer", false); err != nil {
			return err
		}
		c.obs = o
		return nil
	})
}

// WithDrainDeadline sets how long a closed lease may stay unsettled. When
// the deadline passes, the pool reports it (EventDeadline) and quarantines
// the lease's still-pending transfers with reason ErrDrainDeadline: their
// blocks are counted as Quarantined and never reused. It then cancels
// them (Transfer.Cancel), so a transport that honours its cancel hook
// returns and resolves: that late Resolve is the evidence that lifts the
// quarantine. Time is never evidence, so nothing is freed by the deadline
// itself. Quarantining and cancelling act on the transfer, so every other
// lease it gates (the other side of a copy) is quarantined too, and that
// copy ends: the transfer failed to prove quiescence in time for anyone.
// d must be positive; the default is no deadline.
func WithDrainDeadline(d time.Duration) Option {
	return newOption(fmt.Sprintf("WithDrainDeadline(%v)", d), func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("kvlease: drain deadline %v must be positive: %w", d, ErrInvalidArgument)
		}
		if err := c.claim("drain deadline", c.deadline == d); err != nil {
			return err
		}
		c.deadline = d
		return nil
	})
}

// WithLeakCheck turns the leak check on or off. When on, every lease gets a
// runtime cleanup (one extra allocation) that reports EventLeaked to the
// observer if the lease becomes unreachable while still open. It is on by
// default in checked builds (-race or -tags invariants) and off otherwise.
// A leaked lease's blocks are never reclaimed: they stay leased.
func WithLeakCheck(on bool) Option {
	return newOption(fmt.Sprintf("WithLeakCheck(%v)", on), func(c *config) error {
		if err := c.claim("leak check", c.leakCheck == on); err != nil {
			return err
		}
		c.leakCheck = on
		return nil
	})
}

// WithQuarantineAlert asks the pool to tell the observer when quarantined
// blocks exceed share of its capacity (0 ≤ share < 1): EventQuarantineAlert
// when the count rises above share × capacity, EventQuarantineRecovered
// when late evidence brings it back to or below that. Quarantine is
// right (unknown means never reused), but a pool losing its capacity to it
// needs an operator. The default is no alert.
func WithQuarantineAlert(share float64) Option {
	return newOption(fmt.Sprintf("WithQuarantineAlert(%v)", share), func(c *config) error {
		if !(share >= 0 && share < 1) { // NaN fails too
			return fmt.Errorf("kvlease: quarantine alert share %v must be in [0, 1): %w", share, ErrInvalidArgument)
		}
		if err := c.claim("quarantine alert share", c.alertShare == share); err != nil {
			return err
		}
		c.alert, c.alertShare = true, share
		return nil
	})
}

// alertLimit is the quarantined block count above which the alert fires,
// or math.MaxInt for none.
func (c *config) alertLimit(capacity int) int {
	if !c.alert {
		return math.MaxInt
	}
	return int(c.alertShare * float64(capacity))
}

// WithBlockTokens tells the pool how many tokens fill a block. It enables
// AcquirePrefixTokens and CachedPrefixTokens, and fills BlockSize in KV
// events. blockTokens must be in [1, 2²⁰] (ErrInvalidArgument otherwise).
func WithBlockTokens(blockTokens int) Option {
	return newOption(fmt.Sprintf("WithBlockTokens(%d)", blockTokens), func(c *config) error {
		return c.setBlockTokens(blockTokens)
	})
}

// WithVerifiedPrefix turns on verified mode (see the package's Prefix
// cache section) for blocks of blockTokens tokens: blocks are sealed only
// with SealTokens, and every prefix hit of AcquirePrefixTokens is checked
// against the sealed block's parent and tokens. Hash-only lookups
// (AcquirePrefix, CachedPrefix) cannot be verified and always miss. It
// sets the block tokens as WithBlockTokens does: the two may be combined
// only with the same value.
func WithVerifiedPrefix(blockTokens int) Option {
	return newOption(fmt.Sprintf("WithVerifiedPrefix(%d)", blockTokens), func(c *config) error {
		if err := c.setBlockTokens(blockTokens); err != nil {
			return err
		}
		c.verify = true
		return nil
	})
}

// maxBlockTokens bounds WithBlockTokens, so that a pool's token count
// (capacity × block tokens, capacity < 2³¹) always fits an int.
const maxBlockTokens = 1 << 20

func (c *config) setBlockTokens(blockTokens int) error {
	if blockTokens <= 0 || blockTokens > maxBlockTokens {
		return fmt.Errorf("kvlease: %s: block tokens must be in [1, %d]: %w", c.applyingName, maxBlockTokens, ErrInvalidArgument)
	}
	if err := c.claim("block tokens", c.blockTokens == blockTokens); err != nil {
		return err
	}
	c.blockTokens = blockTokens
	return nil
}

// WithSealRecords makes the pool record how each block is sealed (its
// parent, whether the parent is a block, its tokens when sealed with
// them), for Pool.SealInfo to report; a tiered cache (package tiers)
// requires it of its device and host pools, to seal a block's copies as
// the original was sealed. Verified mode and KV events keep the record
// anyway; a pool with none of the three skips it, which keeps its seals
// and evictions cheapest. The tokens take blockTokens int32s per block,
// allocated at the first seal with tokens.
func WithSealRecords() Option {
	return newOption("WithSealRecords", func(c *config) error {
		c.sealRecords = true
		return nil
	})
}
