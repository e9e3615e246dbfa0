package doclock

import (
	"encoding/base64"
	"strings"
	"unicode/utf8"
)

// Verbatim reports whether key may be stored under its own name on both
// services: it is valid UTF-8, does not start with "~" (the mark of an
// encoded name), and does not both start and end with "__" (a name the
// services reserve). A backend's Name may refuse more (Firestore's "/").
func Verbatim(key string) bool {
	return utf8.ValidString(key) && !strings.HasPrefix(key, "~") && !(strings.HasPrefix(key, "__") && strings.HasSuffix(key, "__"))
}

// Encoded is the name of a key that is not stored verbatim: "~" followed
// by the key in unpadded base64url. Distinct keys get distinct names.
func Encoded(key string) string { return "~" + base64.RawURLEncoding.EncodeToString([]byte(key)) }

// KeyOf is the inverse of a backend's Name, given as name: the key stored
// under s, and false for a name that Name does not produce.
func KeyOf(s string, name func(key string) string) (string, bool) {
	key := s
	if rest, ok := strings.CutPrefix(s, "~"); ok {
		raw, err := base64.RawURLEncoding.DecodeString(rest)
		if err != nil {
			return "", false
		}
		key = string(raw)
	}
	if name(key) != s {
		return "", false
	}
	return key, true
}
