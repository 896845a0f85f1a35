package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/kvlease/kvlease"
)

// TestTenantQuotas: the key file gives tenants quotas (old lines without
// one still work); a request of a tenant that cannot fit within its cap
// is refused with 429 while another tenant's same request is served;
// /metrics reports each tenant's usage; a malformed quota is refused
// without the file's secrets in the error.
func TestTenantQuotas(t *testing.T) {
	dir := t.TempDir()
	path := dir + "/keys"
	keys := "# key=tenant [cap=N] [reserve=M]\nk-alice=alice cap=8 reserve=4\nk-alice2 = alice\nk-bob=bob\n"
	if err := os.WriteFile(path, []byte(keys), 0o600); err != nil {
		t.Fatal(err)
	}
	o, err := parseFlags([]string{"-api-keys", path, "-addr", "127.0.0.1:0", "-metrics", "127.0.0.1:0"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if q := o.cfg.Quotas["alice"]; q != (kvlease.Quota{Cap: 8, Reserve: 4}) || len(o.cfg.Quotas) != 1 || o.cfg.APIKeys["k-alice2"] != "alice" {
		t.Fatalf("quotas %+v, keys %v", o.cfg.Quotas, o.cfg.APIKeys)
	}
	o.cfg.PrefillBlockTime, o.cfg.DecodeTokenTime = 0, 0
	a := startTest(t, o)
	base := "http://" + a.addr.String()
	post := func(key string, words int) (int, string) {
		b, _ := json.Marshal(map[string]any{"prompt": strings.Repeat("w9 ", words), "max_tokens": 1})
		req, _ := http.NewRequest("POST", base+"/v1/completions", bytes.NewReader(b))
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	if st, body := post("k-alice", 50); st != http.StatusOK {
		t.Fatalf("alice's small request: %d %s", st, body)
	}
	if st, body := post("k-alice2", 200); st != http.StatusTooManyRequests || !strings.Contains(body, "insufficient_quota") {
		t.Fatalf("alice's request past her cap: %d %s", st, body)
	}
	if st, body := post("k-bob", 200); st != http.StatusOK {
		t.Fatalf("bob's same request: %d %s", st, body)
	}
	scrape := func(url string) []byte {
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		m, _ := io.ReadAll(resp.Body)
		return m
	}
	// Tenants' names are the operator's business: the API address (every
	// tenant's key reaches it) has the pool's series but none per tenant.
	if m := scrape(base + "/metrics"); !bytes.Contains(m, []byte("kvlease_blocks")) || bytes.Contains(m, []byte("tenant=")) {
		t.Fatalf("the API's /metrics names tenants or lacks the pool:\n%s", m)
	}
	m := scrape("http://" + a.maddr.String() + "/metrics")
	for _, want := range []string{
		`kvlease_tenant_held_blocks{pool="gpu",tenant="alice"}`,
		`kvlease_tenant_held_blocks{pool="gpu",tenant="bob"}`,
		`tenant="other"`,
	} {
		if !bytes.Contains(m, []byte(want)) {
			t.Fatalf("/metrics lacks %s:\n%s", want, m)
		}
	}
	for _, bad := range []string{
		"k-x=x cap=ten\n", "k-x=x cap=2 reserve=3\n", "k-x=x cap=1 cap=2\n", "k-x=x limit=3\n",
		"k-x=x cap=2\nk-y=x cap=3\n", "k-x=\n",
	} {
		p := dir + "/bad"
		if err := os.WriteFile(p, []byte(bad), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := parseFlags([]string{"-api-keys", p}, io.Discard)
		if err == nil || strings.Contains(err.Error(), "k-x") || strings.Contains(err.Error(), "k-y") {
			t.Fatalf("key file %q: %v", bad, err)
		}
	}
}
