package tcp_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvlease/kvlease/handoff"
)

// writeTLS writes test TLS material into a fresh directory (private to
// the user): a CA and a leaf for each role ("source", "dest"), with URI
// identities spiffe://kvlease/<role>, for 127.0.0.1. It returns the
// directory, which the peer process reads (readTLS).
func writeTLS(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvlease test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	write := func(name, typ string, der []byte) {
		if err := os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("ca.pem", "CERTIFICATE", caDER)
	for i, role := range []string{"source", "dest"} {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		u, _ := url.Parse("spiffe://kvlease/" + role)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(int64(i + 2)), Subject: pkix.Name{CommonName: role},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), URIs: []*url.URL{u},
			DNSNames: []string{"decode"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, KeyUsage: x509.KeyUsageDigitalSignature,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		kb, _ := x509.MarshalECPrivateKey(key)
		write(role+".pem", "CERTIFICATE", der)
		write(role+".key", "EC PRIVATE KEY", kb)
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
