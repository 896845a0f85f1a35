package kvlease

import (
	"bufio"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// releaseHeading is a Keep-a-Changelog release heading: "## [1.2.3] - 2026-12-05".
var releaseHeading = regexp.MustCompile(`^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$`)

// newestRelease returns the version of the first release heading in a
// changelog (the Unreleased section above it is skipped), and whether the
// changelog has an Unreleased section before it.
func newestRelease(t *testing.T, path string) (version string, unreleased bool) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if line == "## [Unreleased]" {
			unreleased = true
			continue
		}
		if m := releaseHeading.FindStringSubmatch(line); m != nil {
			return m[1], unreleased
		}
		if strings.HasPrefix(line, "## ") {
			t.Fatalf("%s: heading %q is neither [Unreleased] nor a release (## [X.Y.Z] - YYYY-MM-DD)", path, line)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	t.Fatalf("%s: no release heading", path)
	return "", false
}

// TestVersionMatchesChangelog: the constant the module reports is the
// newest release CHANGELOG.md describes, below its Unreleased section.
func TestVersionMatchesChangelog(t *testing.T) {
	if !regexp.MustCompile(`^\d+\.\d+\.\d+$`).MatchString(Version) {
		t.Fatalf("Version %q is not MAJOR.MINOR.PATCH", Version)
	}
	got, unreleased := newestRelease(t, "CHANGELOG.md")
	if got != Version {
		t.Fatalf("CHANGELOG.md's newest release is %s, Version is %s", got, Version)
	}
	if !unreleased {
		t.Fatal("CHANGELOG.md has no [Unreleased] section above its newest release")
	}
}

// requiredVersion returns the version at which a go.mod requires module
// mod ("" if it does not), in either the one-line or the block form.
func requiredVersion(t *testing.T, gomod, mod string) string {
	t.Helper()
	b, err := os.ReadFile(gomod)
	if err != nil {
		t.Fatal(err)
	}
	inBlock := false
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		switch {
		case line == "require (":
			inBlock = true
			continue
		case inBlock && line == ")":
			inBlock = false
			continue
		case strings.HasPrefix(line, "require "):
			line = strings.TrimPrefix(line, "require ")
		case !inBlock:
			continue
		}
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == mod {
			return f[1]
		}
	}
	return ""
}

// TestNestedModulesRequireVersion: the nested modules require this
// module at the tag of Version (v0.0.0 resolves only inside this tree,
// through their replace; a consumer resolves the tag).
func TestNestedModulesRequireVersion(t *testing.T) {
	for _, dir := range []string{"ucx", filepath.Join("interop", "llmd")} {
		got := requiredVersion(t, filepath.Join(dir, "go.mod"), "github.com/kvlease/kvlease")
		if got != "v"+Version {
			t.Errorf("%s/go.mod requires github.com/kvlease/kvlease %q, want v%s", dir, got, Version)
		}
	}
}
