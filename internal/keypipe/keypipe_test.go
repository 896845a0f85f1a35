package keypipe

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
)

func TestMain(m *testing.M) {
	if os.Getenv("KEYPIPE_CHILD") == "1" {
		key, ok, err := Read()
		fmt.Printf("%x %v %v\n", key, ok, err)
		// Once read, the descriptor is not read again and the
		// environment no longer names it.
		again, ok, err := Read()
		fmt.Printf("%x %v %v %q\n", again, ok, err != nil, os.Getenv(Env))
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func TestHandsTheKeyDown(t *testing.T) {
	key := bytes.Repeat([]byte{0xC3}, KeyBytes)
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "KEYPIPE_CHILD=1")
	send, err := Attach(cmd, key)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range append(cmd.Args, cmd.Env...) {
		if strings.Contains(a, fmt.Sprintf("%x", key)) || strings.Contains(a, string(key)) {
			t.Fatalf("the key is on the command line or in the environment: %q", a)
		}
	}
	var out bytes.Buffer
	cmd.Stdout = &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if err := send(); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("%x true <nil>\n false true \"\"\n", key); out.String() != want {
		t.Fatalf("child read %q, want %q", out.String(), want)
	}
}

func TestNoKey(t *testing.T) {
	t.Setenv(Env, "")
	if _, ok, err := Read(); ok || err != nil {
		t.Fatalf("no key: ok %v, err %v", ok, err)
	}
	t.Setenv(Env, "1")
	if _, _, err := Read(); err == nil {
		t.Fatal("stdout taken for a key descriptor")
	}
	if _, err := Attach(exec.Command("true"), []byte("short")); err == nil {
		t.Fatal("a short key attached")
	}
}
