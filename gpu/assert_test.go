package gpu

import (
	"bytes"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
)

// Small assertion helpers. The module's go.sum carries testify but not its
// dependencies, so these stand in for require without touching go.mod.

func msgOf(msg []any) string {
	if len(msg) == 0 {
		return ""
	}
	if f, ok := msg[0].(string); ok {
		return fmt.Sprintf(f, msg[1:]...) + ": "
	}
	return fmt.Sprint(msg...) + ": "
}

func noErr(t testing.TB, err error, msg ...any) {
	t.Helper()
	if err != nil {
		t.Fatalf("%sunexpected error: %v", msgOf(msg), err)
	}
}

func isErr(t testing.TB, err, target error, msg ...any) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("%serror %v, want one matching %q", msgOf(msg), err, target)
	}
}

func asErr[T error](t testing.TB, err error, target *T) {
	t.Helper()
	if !errors.As(err, target) {
		t.Fatalf("error %v is not a %T", err, *target)
	}
}

func contains(t testing.TB, err error, substr string) {
	t.Helper()
	if err == nil || !strings.Contains(err.Error(), substr) {
		t.Fatalf("error %v, want one containing %q", err, substr)
	}
}

func eq[T any](t testing.TB, want, got T, msg ...any) {
	t.Helper()
	if w, ok := any(want).([]byte); ok {
		g := any(got).([]byte)
		if !bytes.Equal(w, g) {
			i := 0
			for i < len(w) && i < len(g) && w[i] == g[i] {
				i++
			}
			t.Fatalf("%sbytes differ: len %d vs %d, first difference at %d", msgOf(msg), len(w), len(g), i)
		}
		return
	}
	if !reflect.DeepEqual(want, got) {
		t.Fatalf("%sgot %v, want %v", msgOf(msg), got, want)
	}
}

func zero[T comparable](t testing.TB, got T, msg ...any) {
	t.Helper()
	var z T
	if got != z {
		t.Fatalf("%sgot %v, want zero", msgOf(msg), got)
	}
}

func same[T any](t testing.TB, want, got *T) {
	t.Helper()
	if want != got {
		t.Fatalf("got %p, want %p", got, want)
	}
}

func isNil(t testing.TB, got any, msg ...any) {
	t.Helper()
	if got != nil && !reflect.ValueOf(got).IsNil() {
		t.Fatalf("%sgot %v, want nil", msgOf(msg), got)
	}
}

func notNil(t testing.TB, got any, msg ...any) {
	t.Helper()
	if got == nil || reflect.ValueOf(got).IsNil() {
		t.Fatalf("%sgot nil", msgOf(msg))
	}
}

func isFalse(t testing.TB, b bool, msg ...any) {
	t.Helper()
	if b {
		t.Fatalf("%swant false", msgOf(msg))
	}
}
