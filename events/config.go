package events

// A Publisher's configuration, its defaults and its counters.

import (
	"log/slog"
	"time"
)

// Defaults of Config.
const (
	// DefaultEndpoint is where a Publisher binds when Config.Endpoint is
	// empty: vLLM's port, on loopback only.
	DefaultEndpoint         = "tcp://127.0.0.1:5557"
	DefaultHWM              = 100_000
	DefaultReplayBatches    = 10_000
	DefaultQueue            = 4096
	DefaultBatchEvents      = 512
	DefaultLinger           = time.Millisecond
	DefaultHandshakeTimeout = 5 * time.Second
	DefaultMaxPeerMessage   = 1 << 20
	DefaultMaxSubscribers   = 64
	DefaultMaxHandshakes    = 32
	DefaultMaxPerAddress    = 8
	DefaultSendTimeout      = 30 * time.Second
	DefaultReplayIdle       = 30 * time.Second
)

// Config configures a Publisher. Every field has a default.
type Config struct {
	// Endpoint of the PUB socket, tcp://HOST:PORT or ipc://PATH
	// (DefaultEndpoint, bound, when empty). Following vLLM, the socket
	// binds when the endpoint contains "*" or "::" or is ipc://, and
	// connects otherwise (a router that binds and lets engines dial in);
	// Bind forces a bind. tcp://*:PORT binds every interface: anyone who
	// reaches the port reads the token ids of every cached block, so that
	// choice is logged (Logger, warning level).
	Endpoint string
	// Bind forces binding (true) whatever the endpoint looks like.
	Bind bool
	// ReplayEndpoint, when set, is bound as a ROUTER socket that replays
	// the last ReplayBatches batches: a request [id, "", start_seq (8 bytes
	// big-endian)] is answered [id, "", topic, seq, payload] per batch
	// with seq ≥ start_seq, at most ReplayPerRequest of them (a client
	// that got that many asks again from the last seq + 1), then
	// [id, "", "", 0xFF×8, ""]. A request of another shape is ignored.
	ReplayEndpoint string
	// ReplayPerRequest bounds the batches of one replay answer (default:
	// ReplayBatches, the whole ring, which clients that expect the whole
	// history in one answer, such as Dynamo's startup replay, need). A
	// smaller bound makes each request cheaper; such clients then miss
	// the rest.
	ReplayPerRequest int
	// Topic of every message; "kv@<Pod>@<Model>" when empty.
	Topic      string
	Pod, Model string
	// Encoding of events: MapEncoding (default) or ArrayEncoding.
	Encoding Encoding
	// DataParallelRank is the batch's third field.
	DataParallelRank int
	// HWM is the PUB socket's high-water mark (DefaultHWM): the messages
	// queued for one subscriber; a message that finds its queue full is
	// dropped for that subscriber only and counted (Stats.SubscriberDrops).
	HWM int
	// ReplayBatches is how many batches the replay socket keeps
	// (DefaultReplayBatches).
	ReplayBatches int
	// Queue is how many encoded batches may wait for the socket
	// (DefaultQueue); a batch that finds it full is dropped and counted,
	// and the publisher resynchronises (see Publisher).
	Queue int
	// BatchEvents caps the events of one batch (DefaultBatchEvents).
	BatchEvents int
	// Linger is how long the publisher lets events gather after a pool
	// signals the first ones, before it drains the pools; while events
	// keep coming it drains every Linger without waiting for a signal.
	// Fewer, larger batches and fewer trips through the pools' locks, for
	// at most this much latency (DefaultLinger; negative: drain at once).
	// Flush does not wait for it.
	Linger time.Duration

	// What any one peer (subscriber or replay client) may cost, on both
	// sockets. HandshakeTimeout bounds a connection's ZMTP handshake
	// (DefaultHandshakeTimeout), and how long a subscriber may hold no
	// subscription (from its handshake or its last CANCEL): one that
	// subscribes to nothing is sent nothing, so only this ends it
	// (Stats.IdleDrops). MaxPeerMessage bounds the bytes of one message
	// or command a peer sends (DefaultMaxPeerMessage): a larger one ends
	// the connection before anything is allocated for it.
	//
	// MaxSubscribers caps the established connections of each socket
	// (DefaultMaxSubscribers), MaxHandshakes those still in their
	// handshake (DefaultMaxHandshakes), and MaxPerAddress those of one
	// remote address in each of the two (DefaultMaxPerAddress; an IPv6
	// address counts by its /64, an ipc:// peer is one address). When a
	// cap is full, a connection from an address that holds fewer than the
	// busiest address takes the place of that address's oldest, which is
	// closed: an address flooding the socket (or redialling as it is
	// closed) never locks out a router from another. A connection refused
	// or displaced is counted (Stats.Refused).
	//
	// SendTimeout ends a connection that accepts no byte for that long
	// (DefaultSendTimeout; negative: never); until then a subscriber that
	// does not read only loses messages to its HWM. ReplayIdleTimeout
	// ends a replay client that sends no request for that long after its
	// handshake or its last answer (DefaultReplayIdle; negative: never;
	// Stats.IdleDrops): a DEALER reconnects by itself when it next asks.
	HandshakeTimeout  time.Duration
	MaxPeerMessage    int
	MaxSubscribers    int
	MaxHandshakes     int
	MaxPerAddress     int
	SendTimeout       time.Duration
	ReplayIdleTimeout time.Duration

	// Logger receives the bind-all warning and connection errors
	// (slog.Default() when nil).
	Logger *slog.Logger

	sendHook func(seq uint64, payload []byte) // tests: replaces the PUB socket
}

// Stats counts what a Publisher did.
type Stats struct {
	Batches        uint64 // batches handed to the PUB socket
	Events         uint64 // events in those batches (merged chains count as one)
	Blocks         uint64 // block hashes announced stored or removed
	DroppedBatches uint64 // batches dropped because the queue to the socket was full
	DroppedEvents  uint64 // events the pools' rings dropped before they were drained
	Unpublishable  uint64 // stored events without tokens (routers key blocks by tokens)
	Resyncs        uint64 // AllBlocksCleared + snapshot re-announcements after a loss

	SubscriberDrops  uint64 // messages dropped for one subscriber whose queue was at its HWM
	Refused          uint64 // connections refused or displaced (caps, see Config) or closed in their handshake (timeout, protocol violation)
	IdleDrops        uint64 // subscribers dropped holding no subscription, replay clients dropped idle (see Config)
	MalformedReplays uint64 // replay requests of the wrong shape, ignored
}
