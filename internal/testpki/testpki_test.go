package testpki_test

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvlease/kvlease/internal/testpki"
)

func TestIssueVerifiesAgainstCA(t *testing.T) {
	ca := testpki.NewCA(t, "ca")
	c := ca.Issue(t, testpki.Leaf{Name: "x", URI: "spiffe://kvlease/x", DNS: []string{"decode"},
		IPs: []net.IP{net.IPv4(127, 0, 0, 1)}, Usage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
	leaf, err := x509.ParseCertificate(c.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: ca.Pool, DNSName: "decode", KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		t.Fatalf("verify: %v", err)
	}
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != "spiffe://kvlease/x" || !leaf.IPAddresses[0].Equal(net.IPv4(127, 0, 0, 1)) {
		t.Fatalf("SANs %v %v", leaf.URIs, leaf.IPAddresses)
	}
	other := testpki.NewCA(t, "other")
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: other.Pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err == nil {
		t.Fatal("a leaf verified against another CA")
	}
	old := ca.Issue(t, testpki.Leaf{Name: "old", NotAfter: time.Now().Add(-time.Minute)})
	oldLeaf, _ := x509.ParseCertificate(old.Certificate[0])
	if _, err := oldLeaf.Verify(x509.VerifyOptions{Roots: ca.Pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err == nil {
		t.Fatal("an expired leaf verified")
	}
}

func TestWriteKeyPairRoundTrips(t *testing.T) {
	dir := t.TempDir()
	ca := testpki.NewCA(t, "ca")
	c := ca.Issue(t, testpki.Leaf{Name: "x"})
	certPath, keyPath, caPath := filepath.Join(dir, "x.pem"), filepath.Join(dir, "x.key"), filepath.Join(dir, "ca.pem")
	testpki.WriteKeyPair(t, c, certPath, keyPath)
	ca.WriteCA(t, caPath)
	back, err := tls.LoadX509KeyPair(certPath, keyPath)
	if err != nil {
		t.Fatal(err)
	}
	if string(back.Certificate[0]) != string(c.Certificate[0]) {
		t.Fatal("certificate changed through the files")
	}
	if fi, err := os.Stat(keyPath); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file %v %v", fi, err)
	}
	pemCA, err := os.ReadFile(caPath)
	if err != nil {
		t.Fatal(err)
	}
	if pool := x509.NewCertPool(); !pool.AppendCertsFromPEM(pemCA) {
		t.Fatal("the CA file holds no certificate")
	}
}
