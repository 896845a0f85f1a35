// Package testpki makes throwaway X.509 material for tests: a certificate
// authority, leaf certificates it issues (P-256 keys), and their PEM files
// for a peer process. It is test support only, shared by the root module's
// tests and the nested ucx module's (internal to github.com/kvlease/kvlease).
package testpki

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
	"testing"
	"time"
)

// CA is a certificate authority made for one test.
type CA struct {
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey
	Pool *x509.CertPool // holds Cert alone
}

// NewCA makes a CA named name, valid from two hours ago for a day.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{SerialNumber: serial(t), Subject: pkix.Name{CommonName: name},
		NotBefore: now.Add(-2 * time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &CA{Cert: cert, Key: key, Pool: pool}
}

// Leaf describes a leaf certificate to issue.
type Leaf struct {
	Name  string   // the subject's common name
	URI   string   // a URI SAN (the identity a half reports), or ""
	DNS   []string // DNS SANs
	IPs   []net.IP // IP SANs
	Usage []x509.ExtKeyUsage
	// NotAfter is the end of validity; zero: a day from now. Validity
	// starts two hours ago.
	NotAfter time.Time
}

// Issue returns a certificate for l signed by ca, with its private key.
func (ca *CA) Issue(t testing.TB, l Leaf) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{SerialNumber: serial(t), Subject: pkix.Name{CommonName: l.Name},
		NotBefore: now.Add(-2 * time.Hour), NotAfter: l.NotAfter, DNSNames: l.DNS, IPAddresses: l.IPs,
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: l.Usage}
	if tmpl.NotAfter.IsZero() {
		tmpl.NotAfter = now.Add(24 * time.Hour)
	}
	if l.URI != "" {
		u, err := url.Parse(l.URI)
		if err != nil {
			t.Fatal(err)
		}
		tmpl.URIs = []*url.URL{u}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// WriteCA writes ca's certificate as PEM to path.
func (ca *CA) WriteCA(t testing.TB, path string) {
	t.Helper()
	writePEM(t, path, "CERTIFICATE", ca.Cert.Raw)
}

// WriteKeyPair writes c (from Issue) as PEM: its certificate to certPath,
// its key to keyPath (readable by the user alone); tls.LoadX509KeyPair
// reads them back.
func WriteKeyPair(t testing.TB, c tls.Certificate, certPath, keyPath string) {
	t.Helper()
	kb, err := x509.MarshalECPrivateKey(c.PrivateKey.(*ecdsa.PrivateKey))
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, certPath, "CERTIFICATE", c.Certificate[0])
	writePEM(t, keyPath, "EC PRIVATE KEY", kb)
}

func writePEM(t testing.TB, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// serial is a random 128-bit serial number.
func serial(t testing.TB) *big.Int {
	t.Helper()
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		t.Fatal(err)
	}
	return n
}
