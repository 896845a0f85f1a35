package tcp_test

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/internal/testpki"
)

// writeTLS writes test TLS material into a fresh directory (private to
// the user): a CA and a leaf for each role ("source", "dest"), with URI
// identities spiffe://kvlease/<role>, for 127.0.0.1. It returns the
// directory, which the peer process reads (readTLS).
func writeTLS(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	ca := testpki.NewCA(t, "kvlease test CA")
	ca.WriteCA(t, filepath.Join(dir, "ca.pem"))
	for _, role := range []string{"source", "dest"} {
		c := ca.Issue(t, testpki.Leaf{Name: role, URI: "spiffe://kvlease/" + role,
			DNS: []string{"decode"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)},
			Usage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}})
		testpki.WriteKeyPair(t, c, filepath.Join(dir, role+".pem"), filepath.Join(dir, role+".key"))
	}
	return dir
}

// readTLS is role's authenticator from writeTLS's directory.
func readTLS(dir, role string) (*handoff.TLS, error) {
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, role+".pem"), filepath.Join(dir, role+".key"))
	if err != nil {
		return nil, err
	}
	caPEM, err := os.ReadFile(filepath.Join(dir, "ca.pem"))
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}}
	if role == "source" {
		cfg.RootCAs, cfg.ServerName = pool, "decode"
	} else {
		cfg.ClientCAs = pool
	}
	return &handoff.TLS{Config: cfg}, nil
}

// TestTLSAcrossProcesses: a clean handoff to a peer process over mutual
// TLS: each side reports the other's certificate identity.
func TestTLSAcrossProcesses(t *testing.T) {
	dir := writeTLS(t)
	auth, err := readTLS(dir, "source")
	if err != nil {
		t.Fatal(err)
	}
	s := newSrcSide(t, sideOpts{auth: auth}, peerConfig{HoldAfter: -1, TLSDir: dir}, procBlockBytes, procPool, nil)
	if p := s.src.Peer(); p.Mode != handoff.AuthTLS || p.Identity != "spiffe://kvlease/dest" {
		t.Fatalf("peer %v", p)
	}
	o, l := s.propose(1, 8, 61)
	if st := waitDone(t, "source", o.Done(), o.State); st != handoff.Delivered {
		t.Fatalf("%v: %v", st, o.History())
	}
	l.Release()
}
