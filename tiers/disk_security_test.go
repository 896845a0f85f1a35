//go:build unix

package tiers

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

// writeSlots writes hashes (one chain) into fresh slots of d, seals them
// and returns their slots.
func writeSlots(t *testing.T, d *Disk, hashes []kvlease.BlockHash) []DiskSlot {
	t.Helper()
	l, err := d.Pool().Acquire("w", len(hashes))
	require.NoError(t, err)
	defer l.Release()
	var writes []SlotWrite
	var slots []DiskSlot
	for k, h := range hashes {
		b := make([]byte, testBlockBytes)
		stamp(b, h)
		writes = append(writes, SlotWrite{Src: b, Dst: d.Region(l.Ref(k).ID), Hash: h, Parent: 9, HasParent: true})
		slots = append(slots, d.Region(l.Ref(k).ID))
	}
	tr, err := d.Write(writes, func(t *kvlease.Transfer) error { return l.Attach(t) })
	require.NoError(t, err)
	<-tr.Done()
	require.NoError(t, tr.Err())
	for k, h := range hashes {
		require.NoError(t, l.Seal(k, h))
	}
	return slots
}

// readSlot reads slot s expecting hash h and returns the transfer's error.
func readSlot(t *testing.T, d *Disk, s DiskSlot, h kvlease.BlockHash) error {
	t.Helper()
	l, err := d.Pool().Acquire("r", 1)
	require.NoError(t, err)
	defer l.Release()
	dst := make([]byte, testBlockBytes)
	tr, err := d.Read([]SlotRead{{Src: s, Dst: dst, Hash: h}}, func(t *kvlease.Transfer) error { return l.Attach(t) })
	require.NoError(t, err)
	<-tr.Done()
	if tr.Err() == nil {
		require.True(t, holds(dst, h))
	}
	return tr.Err()
}

func slotFile(dir string) string { return filepath.Join(dir, "tier-000.slots") }

// Slot files are 0600 in a 0700 directory; files left readable by an
// older version are made private.
func TestDiskFilesArePrivate(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "kv")
	cfg := DiskConfig{Dir: dir, Slots: 4, BlockBytes: testBlockBytes, Workers: 1}
	d, err := OpenDisk(cfg)
	require.NoError(t, err)
	require.NoError(t, d.Close())
	fi, err := os.Stat(dir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), fi.Mode().Perm())
	fi, err = os.Stat(slotFile(dir))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())

	require.NoError(t, os.Chmod(slotFile(dir), 0o644))
	d, err = OpenDisk(cfg)
	require.NoError(t, err)
	require.NoError(t, d.Close())
	fi, err = os.Stat(slotFile(dir))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())

	// An existing directory others can list is made private too.
	require.NoError(t, os.Chmod(dir, 0o755))
	d, err = OpenDisk(cfg)
	require.NoError(t, err)
	require.NoError(t, d.Close())
	fi, err = os.Stat(dir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), fi.Mode().Perm())
}

// A directory others can write, or another user owns, is refused; so is
// a slot file that is a symbolic link (it is not followed: its target is
// untouched).
func TestDiskRefusesUnsafeDirectory(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o777))
	_, err := OpenDisk(DiskConfig{Dir: dir, Slots: 4, BlockBytes: testBlockBytes})
	require.ErrorIs(t, err, kvlease.ErrInvalidArgument)
	require.ErrorContains(t, err, "writable by group or others")
	require.NoError(t, os.Chmod(dir, 0o700))

	uid := currentUID
	currentUID = func() int { return uid() + 1 } // as if another user ran us
	_, err = OpenDisk(DiskConfig{Dir: dir, Slots: 4, BlockBytes: testBlockBytes})
	currentUID = uid
	require.ErrorIs(t, err, kvlease.ErrInvalidArgument)
	require.ErrorContains(t, err, "owned by uid")

	target := filepath.Join(t.TempDir(), "victim")
	require.NoError(t, os.WriteFile(target, []byte("precious"), 0o600))
	require.NoError(t, os.Symlink(target, slotFile(dir)))
	_, err = OpenDisk(DiskConfig{Dir: dir, Slots: 4, BlockBytes: testBlockBytes})
	require.ErrorIs(t, err, kvlease.ErrInvalidArgument)
	require.ErrorContains(t, err, "symbolic link")
	got, err := os.ReadFile(target)
	require.NoError(t, err)
	require.Equal(t, "precious", string(got))
}

// A restart recovers every slot written under the same namespace and
// fingerprint, and none under another; a slot of another identity is
// never served by a read either.
func TestDiskRestartOnlyUnderSameIdentity(t *testing.T) {
	dir := t.TempDir()
	key := []byte("0123456789abcdef0123456789abcdef")
	base := DiskConfig{Dir: dir, Files: 2, Slots: 8, BlockBytes: testBlockBytes, Workers: 2,
		Namespace: "llama-3-8b@rev1/bf16", Fingerprint: 0xfeed}
	hashes := chain(3, 5)
	for _, withKey := range []bool{false, true} {
		cfg := base
		if withKey {
			cfg.Key = key
		}
		d, err := OpenDisk(cfg)
		require.NoError(t, err)
		slots := writeSlots(t, d, hashes)
		require.NoError(t, d.Close())

		d, err = OpenDisk(cfg)
		require.NoError(t, err)
		require.Equal(t, len(hashes), d.Recovered(), "same identity: every slot")
		require.Equal(t, len(hashes), d.Pool().CachedPrefix(hashes))
		require.NoError(t, readSlot(t, d, slots[0], hashes[0]))
		require.ErrorIs(t, readSlot(t, d, slots[0], hashes[1]), ErrCorruptSlot, "another hash is a miss")
		require.NoError(t, d.Close())

		others := map[string]DiskConfig{}
		c := cfg
		c.Namespace = "mistral-7b"
		others["namespace"] = c
		c = cfg
		c.Fingerprint = 0xbeef
		others["fingerprint"] = c
		c = cfg
		c.Key = []byte("another key, 16 bytes or more")
		others["key"] = c
		if withKey {
			c = cfg
			c.Key = nil
			others["no key"] = c
		} else {
			c = cfg
			c.Key = key
			others["a key"] = c
		}
		for name, oc := range others {
			d, err := OpenDisk(oc)
			require.NoError(t, err, name)
			require.Zero(t, d.Recovered(), "%s: nothing recovered under another identity", name)
			require.Zero(t, d.Pool().CachedPrefix(hashes), name)
			require.ErrorIs(t, readSlot(t, d, slots[0], hashes[0]), ErrCorruptSlot, "%s: never served", name)
			require.NoError(t, d.Close())
		}
		// The others only read: the slots are still whole for their owner.
		d, err = OpenDisk(cfg)
		require.NoError(t, err)
		require.Equal(t, len(hashes), d.Recovered())
		require.NoError(t, d.Close())
	}
}

// With a key, a slot forged by someone who can write the file but lacks
// the key is a miss: the block replaced and the unkeyed checksum
// recomputed, as an attacker would.
func TestDiskKeyedSlotTamperIsAMiss(t *testing.T) {
	dir := t.TempDir()
	cfg := DiskConfig{Dir: dir, Slots: 2, BlockBytes: testBlockBytes, Workers: 1, Namespace: "m",
		Key: []byte("0123456789abcdef")}
	hashes := chain(7, 1)
	d, err := OpenDisk(cfg)
	require.NoError(t, err)
	slots := writeSlots(t, d, hashes)
	require.NoError(t, d.Close())

	// Forge: an unkeyed tier of the same identity writes the attacker's
	// block into a copy of the file, which then replaces the victim's.
	evil := DiskConfig{Dir: t.TempDir(), Slots: 2, BlockBytes: testBlockBytes, Workers: 1, Namespace: "m"}
	e, err := OpenDisk(evil)
	require.NoError(t, err)
	el, err := e.Pool().Acquire("evil", 2)
	require.NoError(t, err)
	src := make([]byte, testBlockBytes)
	stamp(src, 0xbad)
	tr, err := e.Write([]SlotWrite{{Src: src, Dst: slots[0], Hash: hashes[0]}}, func(t *kvlease.Transfer) error { return el.Attach(t) })
	require.NoError(t, err)
	<-tr.Done()
	require.NoError(t, tr.Err())
	el.Release()
	require.NoError(t, e.Close())
	forged, err := os.ReadFile(slotFile(evil.Dir))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(slotFile(dir), forged, 0o600))
	// The forgery is well formed: an unkeyed tier accepts it.
	e, err = OpenDisk(DiskConfig{Dir: dir, Slots: 2, BlockBytes: testBlockBytes, Workers: 1, Namespace: "m"})
	require.NoError(t, err)
	require.Equal(t, 1, e.Recovered())
	require.NoError(t, e.Close())

	d, err = OpenDisk(cfg)
	require.NoError(t, err)
	defer d.Close()
	require.Zero(t, d.Recovered(), "the forged slot is not recovered")
	require.ErrorIs(t, readSlot(t, d, slots[0], hashes[0]), ErrCorruptSlot, "nor served")

	_, err = OpenDisk(DiskConfig{Dir: t.TempDir(), Slots: 2, BlockBytes: testBlockBytes, Key: []byte("short")})
	require.ErrorIs(t, err, kvlease.ErrInvalidArgument)
}

// The slot files are created in the directory that was checked: a path
// swapped for a symbolic link to another directory right after the
// check (as whoever can write its parent could) does not redirect them.
func TestDiskDirectorySwappedAfterCheck(t *testing.T) {
	parent := t.TempDir()
	dir, moved, elsewhere := filepath.Join(parent, "kv"), filepath.Join(parent, "kv.checked"), t.TempDir()
	dirChecked = func(string) {
		require.NoError(t, os.Rename(dir, moved))
		require.NoError(t, os.Symlink(elsewhere, dir))
	}
	defer func() { dirChecked = func(string) {} }()
	d, err := OpenDisk(DiskConfig{Dir: dir, Slots: 4, BlockBytes: testBlockBytes, Workers: 1})
	require.NoError(t, err)
	require.NoError(t, d.Close())
	_, err = os.Stat(slotFile(moved))
	require.NoError(t, err, "the slot file is in the directory checked")
	_, err = os.Stat(slotFile(elsewhere))
	require.ErrorIs(t, err, os.ErrNotExist, "nothing is created where the swapped path points")
}

// A slot file that is a hard link to another file of ours is refused:
// sizing it would have emptied that file.
func TestDiskRefusesHardLinkedSlotFile(t *testing.T) {
	dir := t.TempDir()
	victim := filepath.Join(t.TempDir(), "victim")
	require.NoError(t, os.WriteFile(victim, []byte("precious"), 0o600))
	require.NoError(t, os.Link(victim, slotFile(dir)))
	_, err := OpenDisk(DiskConfig{Dir: dir, Slots: 4, BlockBytes: testBlockBytes})
	require.ErrorIs(t, err, kvlease.ErrInvalidArgument)
	require.ErrorContains(t, err, "hard links")
	got, err := os.ReadFile(victim)
	require.NoError(t, err)
	require.Equal(t, "precious", string(got))
}
