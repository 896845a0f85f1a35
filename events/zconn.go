package events

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"
)

// endpoint is a parsed ZeroMQ endpoint: tcp://HOST:PORT or ipc://PATH.
type endpoint struct {
	network, addr string
	// all: a tcp endpoint on every interface (*, 0.0.0.0 or ::).
	all bool
}

func (e endpoint) String() string {
	if e.network == "unix" {
		return "ipc://" + e.addr
	}
	if strings.HasPrefix(e.addr, ":") {
		return "tcp://*" + e.addr
	}
	return "tcp://" + e.addr
}

// parseEndpoint parses tcp://HOST:PORT (HOST may be *, an address or a
// name; [v6] in brackets) and ipc://PATH. inproc:// is not served: the
// sockets here are real network sockets.
func parseEndpoint(ep string) (endpoint, error) {
	if path, ok := strings.CutPrefix(ep, "ipc://"); ok {
		if path == "" || path == "*" {
			return endpoint{}, fmt.Errorf("events: endpoint %q: want ipc://PATH: %w", ep, ErrInvalidConfig)
		}
		return endpoint{network: "unix", addr: path}, nil
	}
	rest, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return endpoint{}, fmt.Errorf("events: endpoint %q: want tcp://HOST:PORT or ipc://PATH: %w", ep, ErrInvalidConfig)
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil || port == "" {
		return endpoint{}, fmt.Errorf("events: endpoint %q: %v: %w", ep, err, ErrInvalidConfig)
	}
	e := endpoint{network: "tcp", addr: net.JoinHostPort(host, port)}
	switch host {
	case "*", "":
		e.addr, e.all = ":"+port, true
	case "0.0.0.0", "::":
		e.all = true
	}
	return e, nil
}

// limits bound what any one peer can make a socket do.
type limits struct {
	handshake   time.Duration // greeting and READY, both ways
	maxMessage  int           // bytes a peer may send in one message or command
	maxConns    int           // established peers
	maxPending  int           // peers still in their handshake
	perAddr     int           // of each of the two, from one remote address (peerTable)
	idle        time.Duration // replay: a client that sends no request this long is dropped (≤ 0: never)
	sendTimeout time.Duration // a write that makes no progress this long ends the peer (≤ 0: never)
	hwm         int           // messages queued for one peer; more are dropped
}

// maxPeerFrames bounds the frames of one message a peer sends: a
// subscription is one frame, a replay request two.
const maxPeerFrames = 8

// handshake runs the ZMTP handshake on conn within lim.handshake: our
// greeting and READY go out at once, the peer's are read and checked,
// and the peer's socket type must be one of accept. The returned reader
// holds whatever the peer sent after its READY.
func handshake(conn net.Conn, socketType string, asServer bool, accept []string, lim limits) (readyProps, *bufio.Reader, error) {
	if err := conn.SetDeadline(time.Now().Add(lim.handshake)); err != nil {
		return readyProps{}, nil, err
	}
	out := appendGreeting(make([]byte, 0, 128), asServer)
	out = appendReady(out, socketType)
	if _, err := conn.Write(out); err != nil {
		return readyProps{}, nil, err
	}
	r := bufio.NewReaderSize(conn, 4096)
	var g [greetingLen]byte
	if _, err := io.ReadFull(r, g[:]); err != nil {
		return readyProps{}, nil, fmt.Errorf("events: greeting: %w", err)
	}
	if _, err := parseGreeting(g[:]); err != nil {
		return readyProps{}, nil, err
	}
	var buf []byte
	h, body, err := readFrame(r, lim.maxMessage, &buf)
	if err != nil {
		return readyProps{}, nil, fmt.Errorf("events: READY: %w", err)
	}
	if !h.command() {
		return readyProps{}, nil, fmt.Errorf("events: message before READY: %w", ErrProtocol)
	}
	name, data, err := parseCommand(body)
	if err != nil {
		return readyProps{}, nil, err
	}
	if name != "READY" {
		return readyProps{}, nil, fmt.Errorf("events: %q command before READY: %w", name, ErrProtocol)
	}
	props, err := parseReady(data)
	if err != nil {
		return props, nil, err
	}
	ok := false
	for _, a := range accept {
		ok = ok || props.socketType == a
	}
	if !ok {
		_, _ = conn.Write(appendError(nil, "invalid socket type"))
		return props, nil, fmt.Errorf("events: a %s peer on a %s socket: %w", props.socketType, socketType, ErrProtocol)
	}
	if err := conn.SetDeadline(time.Time{}); err != nil {
		return props, nil, err
	}
	return props, r, nil
}

// deadlineWriter gives every write to a peer a deadline: a peer that
// takes no byte for timeout ends its connection instead of holding a
// goroutine (and its queue) forever.
type deadlineWriter struct {
	conn    net.Conn
	timeout time.Duration
}

func (w deadlineWriter) Write(b []byte) (int, error) {
	if w.timeout > 0 {
		if err := w.conn.SetWriteDeadline(time.Now().Add(w.timeout)); err != nil {
			return 0, err
		}
	}
	return w.conn.Write(b)
}

// peerReader reads a peer's messages and commands after the handshake.
type peerReader struct {
	r     *bufio.Reader
	limit int
	buf   []byte // one message's frames, back to back
	frame []byte // one frame's body while reading it
	ends  []int  // end offset in buf of each frame
	out   [maxPeerFrames][]byte
}

// next reads the next command or whole message. A command returns its
// name and data; a message returns its frames (slices of the reader's
// buffer, valid until the next call). A message over the size limit or
// with more than maxPeerFrames frames, or a command inside a message, is
// a protocol error.
func (p *peerReader) next() (cmd string, data []byte, frames [][]byte, err error) {
	p.buf, p.ends = p.buf[:0], p.ends[:0]
	for {
		h, body, err := readFrame(p.r, p.limit-len(p.buf), &p.frame)
		if err != nil {
			return "", nil, nil, err
		}
		if h.command() {
			if len(p.ends) > 0 {
				return "", nil, nil, fmt.Errorf("events: command inside a message: %w", ErrProtocol)
			}
			name, data, err := parseCommand(body)
			return name, data, nil, err
		}
		if len(p.ends) == maxPeerFrames {
			return "", nil, nil, fmt.Errorf("events: message of more than %d frames: %w", maxPeerFrames, ErrProtocol)
		}
		p.buf = append(p.buf, body...)
		p.ends = append(p.ends, len(p.buf))
		if !h.more() {
			break
		}
	}
	frames = p.out[:len(p.ends)]
	lo := 0
	for i, hi := range p.ends {
		frames[i] = p.buf[lo:hi:hi]
		lo = hi
	}
	return "", nil, frames, nil
}

// isClosedErr reports an error that only says the connection ended.
func isClosedErr(err error) bool {
	return errors.Is(err, net.ErrClosed) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}
