package firestorelock_test

import (
	"strings"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
)

// names is the mapping of keys to Firestore document IDs: an ID holds no
// "/" (a path separator) and is not "." or "..", so keys that are get
// encoded.
var names = doclocktest.Names{
	Service: "Firestore",
	Name:    firestorelock.Name,
	KeyOf:   firestorelock.KeyOf,
	Invalid: func(id string) string {
		if strings.Contains(id, "/") || id == "." || id == ".." {
			return "a slash, . or .."
		}
		return ""
	},
	Want: map[string]string{
		"ключ 鍵 x": "ключ 鍵 x",
		"ключ/鍵 x": "~0LrQu9GO0Ycv6Y21IHg",
		".":        "~Lg",
		"..":       "~Li4",
	},
}

func FuzzName(f *testing.F) { names.Fuzz(f) }

func TestNames(t *testing.T) { names.Run(t) }
