package datastorelock

import (
	"encoding/base64"
	"strings"
	"unicode/utf8"
)

// Name returns the entity name a key is stored under: the key itself when
// it is valid UTF-8, does not start with "~" and does not both start and
// end with "__"; else "~" followed by the key in unpadded base64url. Distinct
// keys get distinct names.
func Name(key string) string {
	if utf8.ValidString(key) && !strings.HasPrefix(key, "~") && !(strings.HasPrefix(key, "__") && strings.HasSuffix(key, "__")) {
		return key
	}
	return "~" + base64.RawURLEncoding.EncodeToString([]byte(key))
}

// keyOf is the inverse of Name: the key stored under name, and false for a
// name that Name does not produce.
func keyOf(name string) (string, bool) {
	key := name
	if rest, ok := strings.CutPrefix(name, "~"); ok {
		raw, err := base64.RawURLEncoding.DecodeString(rest)
		if err != nil {
			return "", false
		}
		key = string(raw)
	}
	if Name(key) != name {
		return "", false
	}
	return key, true
}
