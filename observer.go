package kvlease

// EventKind names a lifecycle transition reported to an Observer.
type EventKind uint8

// The lifecycle transitions an Observer sees.
const (
	// EventAcquired: a lease was handed out (Blocks = its length; Hits = prefix hits).
	EventAcquired EventKind = iota + 1
	// EventRejected: an acquire failed and allocated nothing (Err = why,
	// Blocks = the blocks asked for).
	EventRejected
	// EventExtended: an open lease grew by Blocks.
	EventExtended
	// EventReleased: a lease was closed by Release.
	EventReleased
	// EventAborted: a lease was closed by Abort (Err = the cause).
	EventAborted
	// EventSettled: a closed lease holds none of its blocks any more.
	EventSettled
	// EventAttached: a transfer now gates Blocks blocks of a lease.
	EventAttached
	// EventTransferResolved: a transfer gating the lease resolved (Err = its outcome).
	EventTransferResolved
	// EventTransferQuarantined: a transfer gating the lease ended without
	// proof (Err = the reason); its blocks are quarantined.
	EventTransferQuarantined
	// EventLeaseQuarantined: the lease entered LeaseQuarantined.
	EventLeaseQuarantined
	// EventQuarantineLifted: late evidence resolved the lease's last
	// quarantined transfer.
	EventQuarantineLifted
	// EventDeadline: a closed lease did not settle within the drain
	// deadline; its pending transfers are quarantined (never freed).
	EventDeadline
	// EventLeaked: a lease became unreachable while open. Its blocks stay
	// leased: they are not reclaimed behind the owner's back.
	EventLeaked
	// EventDuplicateSeal: Seal found another block already findable by the
	// same hash; this block is sealed but private.
	EventDuplicateSeal
	// EventQuarantineAlert: quarantined blocks rose above the share of the
	// pool set by WithQuarantineAlert (Blocks = quarantined blocks now,
	// Err says how many of how many). Told once per crossing.
	EventQuarantineAlert
	// EventQuarantineRecovered: late evidence brought the quarantined
	// blocks back to or below the alert share (Blocks = quarantined now).
	EventQuarantineRecovered
	// EventTrimmed: an open lease gave back its Blocks leading blocks
	// with TrimTo (they follow the rules of a release).
	EventTrimmed
)

var eventNames = [...]string{
	EventAcquired:            "acquired",
	EventRejected:            "rejected",
	EventExtended:            "extended",
	EventReleased:            "released",
	EventAborted:             "aborted",
	EventSettled:             "settled",
	EventAttached:            "attached",
	EventTransferResolved:    "transfer-resolved",
	EventTransferQuarantined: "transfer-quarantined",
	EventLeaseQuarantined:    "lease-quarantined",
	EventQuarantineLifted:    "quarantine-lifted",
	EventDeadline:            "deadline",
	EventLeaked:              "leaked",
	EventDuplicateSeal:       "duplicate-seal",
	EventQuarantineAlert:     "quarantine-alert",
	EventQuarantineRecovered: "quarantine-recovered",
	EventTrimmed:             "trimmed",
}

func (k EventKind) String() string {
	if int(k) < len(eventNames) && eventNames[k] != "" {
		return eventNames[k]
	}
	return "event(?)"
}

// Event is one lifecycle transition. Fields that do not apply are zero.
type Event struct {
	Kind     EventKind
	Owner    string // the lease's owner (or the rejected caller)
	Lease    uint64 // the lease's id (Lease.ID), 0 for a rejection
	Transfer uint64 // the transfer's id, for transfer events
	Blocks   int    // blocks concerned
	Hits     int    // prefix hits, for EventAcquired
	Err      error  // cause, reason or outcome
}

// Observer sees every lifecycle transition of a pool (set with
// WithObserver). Observe is called with no internal lock held, after the
// transition took effect, so it may call back into the library; it may be
// called concurrently from several goroutines and should be quick: it runs
// on the caller's path. With no observer set, no event is built.
type Observer interface {
	Observe(Event)
}

// ObserverFunc adapts a function to Observer.
type ObserverFunc func(Event)

// Observe calls f(e).
func (f ObserverFunc) Observe(e Event) { f(e) }

// outbox holds the observer events (and eviction-hook batches) of one
// operation while locks are held, to be delivered after every lock is
// released. One operation may touch several
// pools (a transfer gating a source and a destination lease), each with its
// own observer, so every entry carries its observer. It is one slice
// header: with no observer set nothing is added, nothing allocated, and the
// hot path pays for zeroing 24 bytes.
type outbox struct {
	list []observed
}

type observed struct {
	obs Observer
	ev  Event
}

func (e *outbox) add(o Observer, ev Event) {
	if o == nil {
		return
	}
	e.list = append(e.list, observed{o, ev})
}

// flush delivers the collected events in order. Call with no lock held.
func (e *outbox) flush() {
	for _, x := range e.list {
		x.obs.Observe(x.ev)
	}
	e.list = nil
}
