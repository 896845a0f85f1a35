package kvlease

// Version is the version of this module, without the leading "v" of its
// tag (the release of Version is tagged vVersion, and the nested modules
// ucx/vVersion and interop/llmd/vVersion). CHANGELOG.md's newest release
// heading names it, and the nested modules' go.mod files require it.
const Version = "0.9.0"
