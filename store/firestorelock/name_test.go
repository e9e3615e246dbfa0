package firestorelock_test

import (
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
)

// reservedName is Firestore's reserved pattern for document IDs (__.*__), read
// widely: "." also matches a newline here.
var reservedName = regexp.MustCompile(`(?s)^__.*__$`)

// maxNameLen is Firestore's limit on a document ID, in UTF-8 bytes.
const maxNameLen = 1500

// oddKeys are the keys the other tests store: reserved-looking, "~"-led,
// non-UTF-8, multi-byte, and as long as a key may be.
var oddKeys = []string{
	"orders:PO-1", "ключ/鍵 x", "~tilde", "~", "__reserved__", "__prefix_only", "__", "___", "____",
	"\xff\xfe", "~X19yZXNlcnZlZF9f", "~fnRpbGRl", "é", "a__b__c", "__a\nb__", ".", "..", "a/b", " ",
	"\x01\x02\x7f\x80\xfe\xff", "quote' \"; DROP TABLE records; --", "{hash}tag{x}",
	strings.Repeat("\xfe", store.MaxKeyLen), strings.Repeat("鍵", store.MaxKeyLen/3), strings.Repeat("k", store.MaxKeyLen),
}

// checkName fails t unless Name(key) is a valid Firestore document ID that KeyOf
// maps back to key.
func checkName(t *testing.T, key string) string {
	t.Helper()
	name := firestorelock.Name(key) // never panics, whatever the key
	if store.ValidateKey(key) != nil {
		return name // keys the port refuses never reach Firestore
	}
	switch {
	case name == "":
		t.Fatalf("Name(%q) is empty", key)
	case len(name) > maxNameLen:
		t.Fatalf("Name(%.20q...) is %d bytes, over Firestore's %d", key, len(name), maxNameLen)
	case !utf8.ValidString(name):
		t.Fatalf("Name(%q) = %q is not valid UTF-8", key, name)
	case reservedName.MatchString(name):
		t.Fatalf("Name(%q) = %q matches Firestore's reserved __.*__", key, name)
	case strings.Contains(name, "/") || name == "." || name == "..":
		t.Fatalf("Name(%q) = %q is not a Firestore document ID (a slash, . or ..)", key, name)
	}
	if back, ok := firestorelock.KeyOf(name); !ok || back != key {
		t.Fatalf("KeyOf(Name(%q)) = %q, %v; want the key back", key, back, ok)
	}
	return name
}

// FuzzName checks the mapping from keys to Firestore document IDs: no
// panic, every name valid for Firestore (non-empty, at most 1500 bytes,
// UTF-8, not reserved), a round trip through KeyOf, and injectivity: two
// different keys never share a name. KeyOf accepts only names that Name
// produces, so it must not panic on any string either.
func FuzzName(f *testing.F) {
	for i, k := range oddKeys {
		f.Add(k, oddKeys[(i+1)%len(oddKeys)])
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		na, nb := checkName(t, a), checkName(t, b)
		if a != b && na == nb {
			t.Fatalf("Name(%q) = Name(%q) = %q", a, b, na)
		}
		for _, s := range []string{a, b} {
			if key, ok := firestorelock.KeyOf(s); ok && firestorelock.Name(key) != s {
				t.Fatalf("KeyOf(%q) = %q, whose name is %q", s, key, firestorelock.Name(key))
			}
		}
	})
}

func TestOddKeysMapToValidNames(t *testing.T) {
	seen := map[string]string{}
	for _, k := range oddKeys {
		n := checkName(t, k)
		if prev, ok := seen[n]; ok {
			t.Errorf("Name(%q) = Name(%q) = %q", k, prev, n)
		}
		seen[n] = k
	}
	for _, name := range []string{"~", "~!", "~probe!", "~YQ", "~X19yZXNlcnZlZF9f=", "~" + "fn4", "\xff"} {
		if key, ok := firestorelock.KeyOf(name); ok && firestorelock.Name(key) != name {
			t.Errorf("KeyOf(%q) = %q, whose name is %q", name, key, firestorelock.Name(key))
		}
	}
}

func TestNamesAreOneToOneAndFitFirestore(t *testing.T) {
	cases := map[string]string{
		"orders:PO-1":          "orders:PO-1",
		"ключ 鍵 x":             "ключ 鍵 x",
		"ключ/鍵 x":             "~0LrQu9GO0Ycv6Y21IHg",
		".":                    "~Lg",
		"..":                   "~Li4",
		"~tilde":               "~fnRpbGRl",
		"__reserved__":         "~X19yZXNlcnZlZF9f",
		"__prefix_only":        "__prefix_only",
		"\xff\xfe":             "~__4",
		"~X19yZXNlcnZlZF9f":    "~flgxOXlaWE5sY25abFpGOWY",
		strings.Repeat("é", 3): strings.Repeat("é", 3),
	}
	seen := map[string]string{}
	for k, want := range cases {
		got := firestorelock.Name(k)
		if got != want {
			t.Errorf("Name(%q) = %q, want %q", k, got, want)
		}
		if prev, ok := seen[got]; ok {
			t.Errorf("Name(%q) = Name(%q) = %q", k, prev, got)
		}
		seen[got] = k
	}
	if n := len(firestorelock.Name(strings.Repeat("\xff", store.MaxKeyLen))); n > 1500 {
		t.Fatalf("a %d-byte key maps to a %d-byte name, over Firestore's 1500", store.MaxKeyLen, n)
	}
}

func TestLongAndOddKeysAreStored(t *testing.T) {
	testsvc.Firestore(t)
	b, _ := newBackend(t)
	ctx := t.Context()
	for _, k := range []string{strings.Repeat("\xfe", store.MaxKeyLen), "__reserved__", "~X19yZXNlcnZlZF9f", strings.Repeat("鍵", store.MaxKeyLen/3)} {
		r, err := b.Claim(ctx, k, time.Minute)
		if err != nil || r.Outcome != store.Won || r.Claim.Fence != 1 {
			t.Fatalf("%.12q...: %v fence %d %v", k, r.Outcome, r.Claim.Fence, err)
		}
	}
}
