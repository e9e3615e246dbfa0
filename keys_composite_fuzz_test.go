package idempotency

import (
	"encoding/base64"
	"encoding/json"
	"slices"
	"testing"
)

// splitKeyParts undoes joinKeyParts: it reads the escapes and splits at
// each unescaped separator.
func splitKeyParts(key string) []string {
	var parts []string
	var cur []byte
	for i := 0; i < len(key); i++ {
		switch c := key[i]; {
		case c == '\\' && i+1 < len(key):
			i++
			cur = append(cur, key[i])
		case c == CompositeKeySeparator[0]:
			parts = append(parts, string(cur))
			cur = nil
		default:
			cur = append(cur, c)
		}
	}
	return append(parts, string(cur))
}

// FuzzCompositeKeyIsInjective: two different tuples of part values never
// join into one key, of three parts or of two against three, and a key
// splits back into its tuple. Through CompositeKey, the key of an event is
// equal to another's exactly when every part, as the single KeyFunc reads
// it, is.
func FuzzCompositeKeyIsInjective(f *testing.F) {
	f.Add("a|b", "c", "d", "a", "b|c", "d")
	f.Add(`a\`, "|b", "c", `a\|b`, "", "c")
	f.Add("x", "1", "y", "x", `"1"`, "y")
	kf := CompositeKey(AttributePart("t"), JSONFieldPart("order", "id"), AttributePart("u"))
	singles := []KeyFunc{Attribute("t"), JSONField("order", "id"), Attribute("u")}
	f.Fuzz(func(t *testing.T, a1, a2, a3, b1, b2, b3 string) {
		a, b := []string{a1, a2, a3}, []string{b1, b2, b3}
		ka, kb := joinKeyParts(a), joinKeyParts(b)
		if (ka == kb) != slices.Equal(a, b) {
			t.Fatalf("%q -> %q and %q -> %q", a, ka, b, kb)
		}
		if got := splitKeyParts(ka); !slices.Equal(got, a) {
			t.Fatalf("%q -> %q, which splits into %q", a, ka, got)
		}
		if k2 := joinKeyParts(a[:2]); k2 == kb {
			t.Fatalf("%q and %q share the key %q", a[:2], b, k2)
		}

		// Through CompositeKey: an attribute and a JSON field whose text is
		// the fuzzed string (a JSON value when it is one, else a string).
		event := func(t1, id, u string) (string, []string, error) {
			v := json.RawMessage(id)
			if !json.Valid(v) {
				v, _ = json.Marshal(id)
			}
			data, _ := json.Marshal(map[string]any{"order": map[string]any{"id": v}})
			env, _ := json.Marshal(map[string]any{"message": map[string]any{
				"messageId": "1", "data": base64.StdEncoding.EncodeToString(data),
				"attributes": map[string]string{"t": t1, "u": u},
			}})
			e := newEvent(PubSubEventType, "1", env)
			key, err := kf(e)
			var values []string
			for _, single := range singles {
				s, serr := single(e)
				if r, ok := serr.(*refusedKeyError); ok {
					s, serr = r.key, nil
				}
				if serr != nil {
					return key, nil, err
				}
				values = append(values, s)
			}
			return key, values, err
		}
		keyA, sa, errA := event(a1, a2, a3)
		keyB, sb, errB := event(b1, b2, b3)
		if ra, ok := errA.(*refusedKeyError); ok {
			keyA, errA = ra.key, nil
		}
		if rb, ok := errB.(*refusedKeyError); ok {
			keyB, errB = rb.key, nil
		}
		if (errA == nil) != (sa != nil) || (errB == nil) != (sb != nil) {
			t.Fatalf("CompositeKey's errors %v, %v; the single KeyFuncs' values %q, %q", errA, errB, sa, sb)
		}
		if errA != nil || errB != nil || keyA == "" || keyB == "" {
			if errA == nil && (keyA == "") != slices.Contains(sa, "") {
				t.Fatalf("%q: key %q from the parts %q", a, keyA, sa)
			}
			return
		}
		if (keyA == keyB) != slices.Equal(sa, sb) {
			t.Fatalf("parts %q -> %q, parts %q -> %q", sa, keyA, sb, keyB)
		}
	})
}
