package idempotency

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// KeyFunc resolves the idempotency key of an event. An empty key with a nil
// error means the event has no key: [Idempotent] then refuses it with
// [ErrNoKey] (a 400 nack) unless [AllowUnguarded] is set. A non-nil error
// nacks the event: with a 400 when it wraps [ErrMalformedEvent] or
// [store.ErrInvalidKey] (the message is at fault), else with a 500.
// Idempotent checks the key, behind its prefix, with [store.ValidateKey]
// before any backend call: a key with a NUL byte, or longer than
// [store.MaxKeyLen], is refused. The KeyFuncs of this package return such
// an error themselves (wrapping store.ErrInvalidKey) rather than the key.
// With [WithHashedKeys], Idempotent stores such a key hashed instead, the
// KeyFuncs' ones included.
//
// The key decides what counts as a duplicate. MessageID catches
// redeliveries of one publish; a business key ([Attribute], [JSONField],
// [CompositeKey] of several, or a func of your own) also catches a producer
// publishing the same thing twice.
type KeyFunc func(e event.Event) (string, error)

// MessageID keys an event by its Pub/Sub messageId (see [ParsePubSub]).
// It reads only Pub/Sub messages: any other event's data is refused as
// malformed ([ErrMalformedEvent], a 400). [DefaultKey], Idempotent's
// default, uses it for Pub/Sub messages and [EventID] for other events.
func MessageID() KeyFunc {
	return messageID
}

// EventID keys an event by its CloudEvents source and id: the
// CloudEvents specification makes that pair unique to each distinct
// event, so two events with the same source and id are deliveries of one
// event (Eventarc's retries of a Cloud Storage, Firestore or Audit Log
// event keep both). The key is the source and the id joined as
// [CompositeKey] joins its parts: "//storage.googleapis.com/projects/_/
// buckets/b|1234" for source "//storage.googleapis.com/projects/_/buckets/b"
// and id "1234", with a backslash or a [CompositeKeySeparator] inside
// either escaped, so that no two pairs are one key. An event without an
// id is unkeyed, and so is the event [PushHandler] makes of a push that
// carries no message id (its id is a placeholder). Unlike [MessageID] it
// reads no data: it keys any event.
func EventID() KeyFunc {
	return eventID
}

// eventID is EventID's KeyFunc. The event PushHandler makes of a push
// that carries no message id has a placeholder id, shared by every such
// push: it is unkeyed, never keyed by that id.
func eventID(e event.Event) (string, error) {
	if e.ID() == "" || e.Type() == unidentifiedPushType {
		return "", nil
	}
	return checkedKey(joinKeyParts([]string{e.Source(), e.ID()}), "the event's source and id", e)
}

// DefaultKey is [Idempotent]'s default KeyFunc: [MessageID] for a Pub/Sub
// message (an event of [PubSubEventType], as Eventarc and the push
// handler deliver them), and [EventID] for any other event, such as an
// Eventarc event of Cloud Storage, Firestore or Cloud Audit Logs. A
// messageId with a backslash or a [CompositeKeySeparator] (none that
// Pub/Sub assigns has one) is escaped as CompositeKey escapes a part, so
// that no message ever shares a key with another event's source and id.
func DefaultKey() KeyFunc {
	return defaultKey
}

// defaultKey is DefaultKey's KeyFunc.
func defaultKey(e event.Event) (string, error) {
	if e.Type() != PubSubEventType {
		return eventID(e)
	}
	k, err := messageID(e)
	return escapedMessageKey(e, k, err)
}

// escapedMessageKey is DefaultKey's key of a Pub/Sub message whose
// messageId keyed it as k (or was refused, err): a messageId with a
// backslash or a CompositeKeySeparator, which no id Pub/Sub assigns has
// but a forged push may, is escaped as CompositeKey escapes a part. An
// EventID key holds one separator that no backslash escapes, an escaped
// messageId none: no message is ever taken for a duplicate of another
// event's source and id, hashed (WithHashedKeys) or not.
func escapedMessageKey(e event.Event, k string, err error) (string, error) {
	if r, ok := err.(*refusedKeyError); ok && strings.ContainsAny(r.key, `\`+CompositeKeySeparator) {
		return "", &refusedKeyError{key: joinKeyParts([]string{r.key}), err: r.err}
	}
	if err != nil || !strings.ContainsAny(k, `\`+CompositeKeySeparator) {
		return k, err
	}
	return checkedKey(joinKeyParts([]string{k}), "messageId", e)
}

// messageID decodes only the ids, with encoding/json: the payload and the
// attributes are skipped, not decoded.
func messageID(e event.Event) (string, error) {
	id, alt, err := decodeMessageIDs(e)
	if err != nil {
		return "", err
	}
	return messageIDKey(id, alt, e)
}

// messageIDKey is the default key of e, whose message has the ids id
// (messageId) and alt (message_id).
func messageIDKey(id, alt string, e event.Event) (string, error) {
	id = firstNonEmpty(id, alt)
	if id == "" && e.Type() == PubSubEventType {
		id = e.ID()
	}
	return checkedKey(id, "messageId", e)
}

// decodeMessageIDs is messageID's decode: the message's two ids, or an
// error wrapping ErrMalformedEvent.
func decodeMessageIDs(e event.Event) (id, alt string, err error) {
	var w struct {
		Message *struct {
			MessageID    string `json:"messageId"`
			MessageIDAlt string `json:"message_id"`
		} `json:"message"`
	}
	if err := json.Unmarshal(e.Data(), &w); err != nil {
		return "", "", fmt.Errorf("%w: event %q data is not a Pub/Sub JSON envelope%s: %v", ErrMalformedEvent, e.ID(), otherKeyHint(e), err)
	}
	if w.Message == nil {
		return "", "", fmt.Errorf("%w: event %q data has no \"message\" object%s", ErrMalformedEvent, e.ID(), otherKeyHint(e))
	}
	return w.Message.MessageID, w.Message.MessageIDAlt, nil
}

// checkedKey returns key, or a *refusedKeyError (wrapping
// store.ErrInvalidKey) when the port would refuse it. An empty key stays
// empty: the event is unkeyed.
func checkedKey(key, what string, e event.Event) (string, error) {
	if key == "" {
		return "", nil
	}
	if err := store.ValidateKey(key); err != nil {
		return "", &refusedKeyError{key: key, err: fmt.Errorf("idempotency: event %q: %s is not a usable key (WithHashedKeys stores such keys hashed): %w", e.ID(), what, err)}
	}
	return key, nil
}

// refusedKeyError is a KeyFunc's refusal of a key the port would refuse.
// It keeps the key, which WithHashedKeys stores hashed instead.
type refusedKeyError struct {
	key string
	err error
}

func (e *refusedKeyError) Error() string { return e.err.Error() }

func (e *refusedKeyError) Unwrap() error { return e.err }

// otherKeyHint names, for an event that is not of PubSubEventType, the
// option that keys it: MessageID reads only Pub/Sub messages.
func otherKeyHint(e event.Event) string {
	if e.Type() == PubSubEventType {
		return ""
	}
	return fmt.Sprintf(" (type %q is not a Pub/Sub message: key it with WithKey and a KeyFunc that reads it)", e.Type())
}

// Attribute keys an event by the Pub/Sub message attribute name. A message
// without that attribute is unkeyed.
func Attribute(name string) KeyFunc {
	return func(e event.Event) (string, error) {
		ev, err := ParsePubSub(e)
		if err != nil {
			return "", err
		}
		return checkedKey(ev.Message.Attributes[name], "attribute "+strconv.Quote(name), e)
	}
}

// JSONField keys an event by a field of its Pub/Sub message payload, which
// must be one JSON value: JSONField("order", "id") reads
// {"order":{"id":...}}. The key is the field's JSON value, type included,
// so that two different values are never one key:
//
//	"PO-1"        PO-1              a string is the key as is
//	1, 1.0        json:1, json:1.0  a number: "json:" and its JSON text as written
//	true          json:true         true and false likewise
//	"json:x"      json:"json:x"     a string that starts with "json:": "json:" and the string in JSON
//
// So "1" and 1 are two keys, and so are 1 and 1.0 (the spelling counts).
// A missing or null field, or a path through something other than an
// object, makes the event unkeyed ([ErrNoKey]). These are the message's
// fault, an error wrapping [ErrMalformedEvent] that names the field (a 400
// from [Idempotent] and [PushHandler]): a payload that is not exactly one
// JSON value (not JSON, or followed by anything but white space), a field
// that is an object or an array, and a string field that holds bytes that
// are not UTF-8 or a \u escape of a lone UTF-16 surrogate (which a JSON
// decoder would turn into U+FFFD, making strings that differ only there one
// key). Keys of object members are matched exactly; of two equal ones, the
// last counts.
func JSONField(path ...string) KeyFunc {
	path = slices.Clone(path)
	what := fmt.Sprintf("key field %q", path)
	return func(e event.Event) (string, error) {
		ev, err := ParsePubSub(e)
		if err != nil {
			return "", err
		}
		raw, err := jsonFieldValue(ev.Message.Data, path)
		if err != nil {
			return "", fmt.Errorf("%w: %s of message %q: %v", ErrMalformedEvent, what, ev.Message.ID, err)
		}
		key, err := jsonValueKey(raw)
		if err != nil {
			return "", fmt.Errorf("%w: %s of message %q %v", ErrMalformedEvent, what, ev.Message.ID, err)
		}
		return checkedKey(key, what, e)
	}
}

// jsonFieldValue is the JSON text of the value at path in data, nil when
// there is none (a missing member, or a path through a non-object). An
// error means data is not exactly one JSON value.
func jsonFieldValue(data []byte, path []string) (json.RawMessage, error) {
	raw := json.RawMessage(data)
	if !json.Valid(data) {
		var v struct{}
		err := json.Unmarshal(data, &v) // the syntax error, with its offset
		return nil, fmt.Errorf("the payload is not one JSON value: %v", err)
	}
	for _, p := range path {
		if len(raw) == 0 || raw[firstNonSpace(raw)] != '{' {
			return nil, nil
		}
		var obj map[string]json.RawMessage
		if err := json.Unmarshal(raw, &obj); err != nil {
			return nil, fmt.Errorf("the payload is not JSON: %v", err)
		}
		raw = obj[p]
	}
	return raw, nil
}

// firstNonSpace is the index of the first byte of raw that is not JSON
// white space (raw holds a valid JSON value, so there is one).
func firstNonSpace(raw []byte) int {
	for i, c := range raw {
		if c != ' ' && c != '\t' && c != '\n' && c != '\r' {
			return i
		}
	}
	return 0
}

// jsonKeyPrefix starts the key of a JSON value that is not a plain string
// (see JSONField).
const jsonKeyPrefix = "json:"

// jsonValueKey is JSONField's key for the JSON value raw; "" for none
// (nil or null). Its error completes the sentence "key field ... of
// message ...".
func jsonValueKey(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return "", nil
	}
	switch raw[0] {
	case 'n':
		return "", nil
	case '{':
		return "", errors.New("is an object, not a string, number or boolean")
	case '[':
		return "", errors.New("is an array, not a string, number or boolean")
	case '"':
		if err := checkJSONString(raw); err != nil {
			return "", err
		}
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", fmt.Errorf("is not a JSON string: %v", err)
		}
		if !strings.HasPrefix(s, jsonKeyPrefix) {
			return s, nil
		}
		var b strings.Builder
		enc := json.NewEncoder(&b)
		enc.SetEscapeHTML(false)
		if err := enc.Encode(s); err != nil {
			return "", err
		}
		return jsonKeyPrefix + strings.TrimSuffix(b.String(), "\n"), nil
	}
	return jsonKeyPrefix + string(raw), nil // a number, true or false
}

// checkJSONString refuses a JSON string literal (valid JSON) that a
// decoder would not give back byte for byte: one with bytes that are not
// UTF-8, or with a \u escape of a UTF-16 surrogate that is not half of a
// pair. encoding/json turns both into U+FFFD.
func checkJSONString(lit []byte) error {
	if !utf8.Valid(lit) {
		return errors.New("holds bytes that are not UTF-8")
	}
	hex4 := func(b []byte) rune {
		r, _ := strconv.ParseUint(string(b), 16, 16)
		return rune(r)
	}
	for i := 0; i < len(lit); i++ {
		if lit[i] != '\\' {
			continue
		}
		i++ // the escaped character
		if lit[i] != 'u' {
			continue
		}
		r := hex4(lit[i+1 : i+5])
		i += 4
		switch {
		case 0xDC00 <= r && r <= 0xDFFF:
			return errors.New("holds a lone UTF-16 surrogate (a \\u escape of a low surrogate without its high one)")
		case 0xD800 <= r && r <= 0xDBFF:
			if i+6 < len(lit) && lit[i+1] == '\\' && lit[i+2] == 'u' {
				if lo := hex4(lit[i+3 : i+7]); 0xDC00 <= lo && lo <= 0xDFFF {
					i += 6
					continue
				}
			}
			return errors.New("holds a lone UTF-16 surrogate (a \\u escape of a high surrogate without its low one)")
		}
	}
	return nil
}

// A KeyPart is one part of a [CompositeKey]: a Pub/Sub message attribute
// ([AttributePart]) or a field of the message's JSON payload
// ([JSONFieldPart]). Its zero value is the attribute named "".
type KeyPart struct {
	attr  string
	path  []string
	field bool
}

// AttributePart is the part of a [CompositeKey] that [Attribute](name)
// would key by: the attribute's value, as is.
func AttributePart(name string) KeyPart {
	return KeyPart{attr: name}
}

// JSONFieldPart is the part of a [CompositeKey] that [JSONField](path...)
// would key by: the field's JSON value, type included, by JSONField's
// table (a string as is, "json:1" for the number 1).
func JSONFieldPart(path ...string) KeyPart {
	return KeyPart{path: slices.Clone(path), field: true}
}

// what names the part in errors: as the single KeyFuncs name their field.
func (p KeyPart) what() string {
	if p.field {
		return fmt.Sprintf("key field %q", p.path)
	}
	return "attribute " + strconv.Quote(p.attr)
}

// CompositeKeySeparator separates the parts of a [CompositeKey]'s key.
// Within a part, a backslash and the separator are escaped with a
// backslash.
const CompositeKeySeparator = "|"

// CompositeKey keys an event by several parts of its Pub/Sub message, in
// the order given: CompositeKey(AttributePart("tenant"),
// JSONFieldPart("order", "id")) keys the message with attribute
// tenant=acme and payload {"order":{"id":"PO-1"}} as "acme|PO-1". Each
// part's value is what [Attribute] or [JSONField] would key by; in it, a
// backslash becomes two and [CompositeKeySeparator] becomes `\|`, and the
// values are joined by CompositeKeySeparator, so that no two different
// tuples of values are ever one key (("a|b", "c") is `a\|b|c`, ("a",
// "b|c") is `a|b\|c`).
//
// The payload is decoded once for all the JSONFieldParts, each object on
// their paths once. A part that is malformed by JSONField's rules (a
// payload that is not exactly one JSON value, a field that is an object or
// an array, a string that is not UTF-8 or holds a lone surrogate escape)
// makes the event the message's fault: an error wrapping
// [ErrMalformedEvent] that names the part (a 400 from [Idempotent] and
// [PushHandler]), whatever the other parts hold. Otherwise a part that is
// absent or empty (an absent or empty attribute, a missing or null field)
// makes the event unkeyed, as the single KeyFuncs do ([ErrNoKey], or
// unguarded with [AllowUnguarded]). A joined key that [store.ValidateKey]
// refuses (longer than [store.MaxKeyLen], or with a NUL byte) is refused
// as the single KeyFuncs refuse theirs (an error wrapping
// [store.ErrInvalidKey]), and stored hashed with [WithHashedKeys].
//
// CompositeKey panics without parts. Two CompositeKeys of different parts
// can give one key (an attribute and a field of equal values): give each
// its own [WithKeyPrefix] when they share a backend.
func CompositeKey(parts ...KeyPart) KeyFunc {
	if len(parts) == 0 {
		panic("idempotency: CompositeKey needs at least one part")
	}
	parts = slices.Clone(parts)
	var paths [][]string
	var fields []int // the index in parts of each path
	for i, p := range parts {
		if p.field {
			paths = append(paths, p.path)
			fields = append(fields, i)
		}
	}
	tree := newFieldTree(paths)
	return func(e event.Event) (string, error) {
		ev, err := ParsePubSub(e)
		if err != nil {
			return "", err
		}
		var buf [4]string
		values := buf[:0]
		if len(parts) > len(buf) {
			values = make([]string, 0, len(parts))
		}
		var raws []json.RawMessage
		if len(fields) > 0 {
			if raws, err = tree.values(ev.Message.Data); err != nil {
				return "", fmt.Errorf("%w: %s of message %q: %v", ErrMalformedEvent, parts[fields[0]].what(), ev.Message.ID, err)
			}
		}
		unkeyed := false
		next := 0 // the next of raws
		for _, p := range parts {
			v := ev.Message.Attributes[p.attr]
			if p.field {
				v, err = jsonValueKey(raws[next])
				next++
				if err != nil {
					return "", fmt.Errorf("%w: %s of message %q %v", ErrMalformedEvent, p.what(), ev.Message.ID, err)
				}
			}
			unkeyed = unkeyed || v == ""
			values = append(values, v)
		}
		if unkeyed {
			return "", nil
		}
		return checkedKey(joinKeyParts(values), "composite key", e)
	}
}

// joinKeyParts is CompositeKey's key of values: each escaped, joined by
// CompositeKeySeparator.
func joinKeyParts(values []string) string {
	n := len(values) - 1
	for _, v := range values {
		n += len(v) + strings.Count(v, `\`) + strings.Count(v, CompositeKeySeparator)
	}
	var b strings.Builder
	b.Grow(n)
	for i, v := range values {
		if i > 0 {
			b.WriteString(CompositeKeySeparator)
		}
		for j := 0; j < len(v); j++ {
			if c := v[j]; c == '\\' || c == CompositeKeySeparator[0] {
				b.WriteByte('\\')
			}
			b.WriteByte(v[j])
		}
	}
	return b.String()
}

// fieldTree holds the paths of several JSON fields, merged by their common
// prefixes, so that one walk of a payload decodes each object on them once.
type fieldTree struct {
	ends     []int // the indexes of the paths that end here
	children map[string]*fieldTree
	n        int // how many paths (at the root)
}

func newFieldTree(paths [][]string) *fieldTree {
	root := &fieldTree{n: len(paths)}
	for i, path := range paths {
		node := root
		for _, name := range path {
			child := node.children[name]
			if child == nil {
				if node.children == nil {
					node.children = map[string]*fieldTree{}
				}
				child = &fieldTree{}
				node.children[name] = child
			}
			node = child
		}
		node.ends = append(node.ends, i)
	}
	return root
}

// values is the JSON text of each path's value in data, in the order of
// the paths, with jsonFieldValue's rules: nil for none, and an error when
// data is not exactly one JSON value.
func (t *fieldTree) values(data []byte) ([]json.RawMessage, error) {
	if !json.Valid(data) {
		var v struct{}
		err := json.Unmarshal(data, &v) // the syntax error, with its offset
		return nil, fmt.Errorf("the payload is not one JSON value: %v", err)
	}
	out := make([]json.RawMessage, t.n)
	return out, t.walk(data, out)
}

func (t *fieldTree) walk(raw json.RawMessage, out []json.RawMessage) error {
	for _, i := range t.ends {
		out[i] = raw
	}
	if len(t.children) == 0 || len(raw) == 0 || raw[firstNonSpace(raw)] != '{' {
		return nil // below a non-object, every path is absent
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil {
		return fmt.Errorf("the payload is not JSON: %v", err)
	}
	for name, child := range t.children {
		if err := child.walk(obj[name], out); err != nil {
			return err
		}
	}
	return nil
}
