package datastorelock

import "github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"

// Name returns the entity name a key is stored under: the key itself when
// it is valid UTF-8, does not start with "~" and does not both start and
// end with "__"; else "~" followed by the key in unpadded base64url. Distinct
// keys get distinct names.
func Name(key string) string {
	// An entity name may hold any character: doclock's rules alone.
	if doclock.Verbatim(key) {
		return key
	}
	return doclock.Encoded(key)
}

// keyOf is the inverse of Name: the key stored under name, and false for a
// name that Name does not produce.
func keyOf(name string) (string, bool) { return doclock.KeyOf(name, Name) }
