package main

import (
	"fmt"
	"net"
	"sync"
	"time"
)

// connLimiter is a listener that holds at most perAddr connections from
// one remote address at a time: one more is answered 503 (with
// Retry-After) and closed before anything of it is read. So a client
// that opens connections and trickles on them runs out of its own share,
// not of the process's descriptors, and a client from another address is
// still served.
type connLimiter struct {
	net.Listener
	perAddr int

	mu    sync.Mutex
	conns map[string]int
}

func limitConns(ln net.Listener, perAddr int) *connLimiter {
	return &connLimiter{Listener: ln, perAddr: perAddr, conns: map[string]int{}}
}

// busyResponse is what a connection over the cap reads.
var busyResponse = func() []byte {
	body := `{"error":{"message":"too many connections from this address","type":"server_error","param":null,"code":"too_many_connections"}}` + "\n"
	return fmt.Appendf(nil, "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
}()

func (l *connLimiter) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		addr := remoteHost(c)
		l.mu.Lock()
		ok := l.conns[addr] < l.perAddr
		if ok {
			l.conns[addr]++
		}
		l.mu.Unlock()
		if ok {
			return &limitedConn{Conn: c, l: l, addr: addr}, nil
		}
		// Over the cap: a short answer, written without waiting (the
		// socket's buffer takes it), and the connection is gone.
		_ = c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
		_, _ = c.Write(busyResponse)
		_ = c.Close()
	}
}

func (l *connLimiter) held(addr string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.conns[addr]
}

// remoteHost is the connection's remote IP (its whole address if not TCP).
func remoteHost(c net.Conn) string {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		return a.IP.String()
	}
	return c.RemoteAddr().String()
}

type limitedConn struct {
	net.Conn
	l    *connLimiter
	addr string
	once sync.Once
}

func (c *limitedConn) Close() error {
	c.once.Do(func() {
		c.l.mu.Lock()
		if c.l.conns[c.addr]--; c.l.conns[c.addr] == 0 {
			delete(c.l.conns, c.addr)
		}
		c.l.mu.Unlock()
	})
	return c.Conn.Close()
}
