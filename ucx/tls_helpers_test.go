package ucx_test

import (
	"crypto/tls"
	"crypto/x509"
	"testing"

	"github.com/kvlease/kvlease/internal/testpki"
)

// prefillIdentity is the URI SAN of the test's prefill certificate: the
// identity the destination half reports for it.
const prefillIdentity = "spiffe://kvlease.test/prefill"

// testTLS returns mutual TLS configs for a source (prefill, client) and a
// destination (decode, server), both issued by a CA made for the test.
func testTLS(t testing.TB) (source, destination *tls.Config) {
	t.Helper()
	ca := testpki.NewCA(t, "kvlease test CA")
	client := ca.Issue(t, testpki.Leaf{Name: "prefill", URI: prefillIdentity,
		Usage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	server := ca.Issue(t, testpki.Leaf{Name: "decode", DNS: []string{"decode.test"},
		Usage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
	source = &tls.Config{Certificates: []tls.Certificate{client}, RootCAs: ca.Pool, ServerName: "decode.test"}
	destination = &tls.Config{Certificates: []tls.Certificate{server}, ClientCAs: ca.Pool}
	return source, destination
}
