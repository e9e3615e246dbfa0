package doclocktest

import (
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Names is a driver's mapping of keys to the names (entity names,
// document IDs) its records are stored under.
type Names struct {
	// Service names the service in messages ("Datastore").
	Service string
	// Name is the driver's Name; KeyOf its inverse.
	Name  func(key string) string
	KeyOf func(name string) (string, bool)
	// Invalid returns why name is not a valid name on the service, beyond
	// the rules both services share (non-empty, at most 1500 bytes,
	// UTF-8, not __.*__); "" when it is valid.
	Invalid func(name string) string
	// Want maps keys to the names they must get, beside the cases both
	// drivers share.
	Want map[string]string
}

// reservedName is the services' reserved pattern for names (__.*__), read
// widely: "." also matches a newline here.
var reservedName = regexp.MustCompile(`(?s)^__.*__$`)

// maxNameLen is the services' limit on a name, in UTF-8 bytes.
const maxNameLen = 1500

// oddKeys are the keys the name cases store: reserved-looking, "~"-led,
// non-UTF-8, multi-byte, and as long as a key may be.
var oddKeys = []string{
	"orders:PO-1", "ключ/鍵 x", "~tilde", "~", "__reserved__", "__prefix_only", "__", "___", "____",
	"\xff\xfe", "~X19yZXNlcnZlZF9f", "~fnRpbGRl", "é", "a__b__c", "__a\nb__", ".", "..", "a/b", " ",
	"\x01\x02\x7f\x80\xfe\xff", "quote' \"; DROP TABLE records; --", "{hash}tag{x}",
	strings.Repeat("\xfe", store.MaxKeyLen), strings.Repeat("鍵", store.MaxKeyLen/3), strings.Repeat("k", store.MaxKeyLen),
}

// check fails t unless Name(key) is a valid name that KeyOf maps back to
// key.
func (n Names) check(t *testing.T, key string) string {
	t.Helper()
	name := n.Name(key) // never panics, whatever the key
	if store.ValidateKey(key) != nil {
		return name // keys the port refuses never reach the service
	}
	switch {
	case name == "":
		t.Fatalf("Name(%q) is empty", key)
	case len(name) > maxNameLen:
		t.Fatalf("Name(%.20q...) is %d bytes, over %s's %d", key, len(name), n.Service, maxNameLen)
	case !utf8.ValidString(name):
		t.Fatalf("Name(%q) = %q is not valid UTF-8", key, name)
	case reservedName.MatchString(name):
		t.Fatalf("Name(%q) = %q matches %s's reserved __.*__", key, name, n.Service)
	}
	if why := n.Invalid(name); why != "" {
		t.Fatalf("Name(%q) = %q is not valid on %s: %s", key, name, n.Service, why)
	}
	if back, ok := n.KeyOf(name); !ok || back != key {
		t.Fatalf("KeyOf(Name(%q)) = %q, %v; want the key back", key, back, ok)
	}
	return name
}

// roundTrip fails t when KeyOf accepts s as a name that Name does not
// give its key.
func (n Names) roundTrip(t *testing.T, s string) {
	t.Helper()
	if key, ok := n.KeyOf(s); ok && n.Name(key) != s {
		t.Fatalf("KeyOf(%q) = %q, whose name is %q", s, key, n.Name(key))
	}
}

// Fuzz checks the mapping from keys to names: no panic, every name valid
// for the service (non-empty, at most 1500 bytes, UTF-8, not reserved,
// and Invalid's rules), a round trip through KeyOf, and injectivity: two
// different keys never share a name. KeyOf accepts only names that Name
// produces, so it must not panic on any string either.
func (n Names) Fuzz(f *testing.F) {
	for i, k := range oddKeys {
		f.Add(k, oddKeys[(i+1)%len(oddKeys)])
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		na, nb := n.check(t, a), n.check(t, b)
		if a != b && na == nb {
			t.Fatalf("Name(%q) = Name(%q) = %q", a, b, na)
		}
		n.roundTrip(t, a)
		n.roundTrip(t, b)
	})
}

// Run checks the mapping on the odd keys and the names it must give.
func (n Names) Run(t *testing.T) {
	t.Run("OddKeysMapToValidNames", func(t *testing.T) {
		seen := map[string]string{}
		for _, k := range oddKeys {
			name := n.check(t, k)
			if prev, ok := seen[name]; ok {
				t.Errorf("Name(%q) = Name(%q) = %q", k, prev, name)
			}
			seen[name] = k
		}
		for _, name := range []string{"~", "~!", "~probe!", "~YQ", "~X19yZXNlcnZlZF9f=", "~" + "fn4", "\xff"} {
			n.roundTrip(t, name)
		}
	})
	t.Run("NamesAreOneToOneAndFit", func(t *testing.T) {
		cases := map[string]string{
			"orders:PO-1":          "orders:PO-1",
			"~tilde":               "~fnRpbGRl",
			"__reserved__":         "~X19yZXNlcnZlZF9f",
			"__prefix_only":        "__prefix_only",
			"\xff\xfe":             "~__4",
			"~X19yZXNlcnZlZF9f":    "~flgxOXlaWE5sY25abFpGOWY",
			strings.Repeat("é", 3): strings.Repeat("é", 3),
		}
		for k, want := range n.Want {
			cases[k] = want
		}
		seen := map[string]string{}
		for k, want := range cases {
			got := n.Name(k)
			if got != want {
				t.Errorf("Name(%q) = %q, want %q", k, got, want)
			}
			if prev, ok := seen[got]; ok {
				t.Errorf("Name(%q) = Name(%q) = %q", k, prev, got)
			}
			seen[got] = k
		}
		if l := len(n.Name(strings.Repeat("\xff", store.MaxKeyLen))); l > maxNameLen {
			t.Fatalf("a %d-byte key maps to a %d-byte name, over %s's %d", store.MaxKeyLen, l, n.Service, maxNameLen)
		}
	})
}

// Long and odd keys are stored and claimed (their names are valid on the
// emulator).
func longAndOddKeysAreStored(t *testing.T, drv h) {
	drv.Emulator(t)
	b, _ := drv.New(t, Config{})
	ctx := t.Context()
	for _, k := range []string{strings.Repeat("\xfe", store.MaxKeyLen), "__reserved__", "~X19yZXNlcnZlZF9f", strings.Repeat("鍵", store.MaxKeyLen/3)} {
		r, err := b.Claim(ctx, k, time.Minute)
		if err != nil || r.Outcome != store.Won || r.Claim.Fence != 1 {
			t.Fatalf("%.12q...: %v fence %d %v", k, r.Outcome, r.Claim.Fence, err)
		}
	}
}

func init() { add(testCase{"LongAndOddKeysAreStored", longAndOddKeysAreStored}) }
