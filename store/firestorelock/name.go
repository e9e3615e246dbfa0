package firestorelock

import (
	"encoding/base64"
	"strings"
	"unicode/utf8"
)

// Name returns the document ID a key is stored under: the key itself when
// it is valid UTF-8, contains no "/", is not "." or "..", does not start
// with "~" and does not both start and end with "__" (Firestore reserves
// __.*__); else "~" followed by the key in unpadded base64url. Distinct
// keys get distinct IDs, and a key of store.MaxKeyLen bytes gets an ID
// within Firestore's 1500-byte limit.
func Name(key string) string {
	if utf8.ValidString(key) && !strings.Contains(key, "/") && key != "." && key != ".." &&
		!strings.HasPrefix(key, "~") && !(strings.HasPrefix(key, "__") && strings.HasSuffix(key, "__")) {
		return key
	}
	return "~" + base64.RawURLEncoding.EncodeToString([]byte(key))
}

// keyOf is the inverse of Name: the key stored under id, and false for an
// ID that Name does not produce.
func keyOf(id string) (string, bool) {
	key := id
	if rest, ok := strings.CutPrefix(id, "~"); ok {
		raw, err := base64.RawURLEncoding.DecodeString(rest)
		if err != nil {
			return "", false
		}
		key = string(raw)
	}
	if Name(key) != id {
		return "", false
	}
	return key, true
}
