//go:build !unix

package tiers

import "os"

const oNoFollow = 0

// ownedByUs: ownership is not checked on systems without Unix owners.
func ownedByUs(os.FileInfo) error { return nil }

// singleLink: hard links are not checked on systems without Unix link
// counts.
func singleLink(os.FileInfo) error { return nil }
