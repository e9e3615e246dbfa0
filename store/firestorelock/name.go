package firestorelock

import (
	"strings"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"
)

// Name returns the document ID a key is stored under: the key itself when
// it is valid UTF-8, contains no "/", is not "." or "..", does not start
// with "~" and does not both start and end with "__" (Firestore reserves
// __.*__); else "~" followed by the key in unpadded base64url. Distinct
// keys get distinct IDs, and a key of store.MaxKeyLen bytes gets an ID
// within Firestore's 1500-byte limit.
func Name(key string) string {
	// Beyond doclock's rules, a document ID holds no "/" (the path
	// separator) and is not "." or "..".
	if doclock.Verbatim(key) && !strings.Contains(key, "/") && key != "." && key != ".." {
		return key
	}
	return doclock.Encoded(key)
}

// keyOf is the inverse of Name: the key stored under id, and false for an
// ID that Name does not produce.
func keyOf(id string) (string, bool) { return doclock.KeyOf(id, Name) }
