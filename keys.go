package idempotency

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"

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
// redeliveries of one publish; a business key ([Attribute], [JSONField], or a
// func of your own) also catches a producer publishing the same thing twice.
type KeyFunc func(e event.Event) (string, error)

// MessageID keys an event by its Pub/Sub messageId (see [ParsePubSub]). It
// is [Idempotent]'s default.
func MessageID() KeyFunc {
	return messageID
}

// messageID reads only the ids: scanMessageIDs picks them out without
// decoding the payload or the attributes, and encoding/json decodes
// whatever that scan leaves to it, so every event gets the key a full
// decode gives it.
func messageID(e event.Event) (string, error) {
	id, alt, ok := scanMessageIDs(e.Data())
	if !ok {
		var err error
		if id, alt, err = decodeMessageIDs(e); err != nil {
			return "", err
		}
	}
	id = firstNonEmpty(id, alt)
	if id == "" && e.Type() == PubSubEventType {
		id = e.ID()
	}
	return checkedKey(id, "messageId", e)
}

// decodeMessageIDs is messageID's decode with encoding/json, for whatever
// scanMessageIDs leaves to it (and its refusals of malformed data).
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
// must be a JSON object: JSONField("order", "id") reads {"order":{"id":...}}.
// A string is used as is; a number or boolean in its JSON spelling. A
// missing or null field makes the event unkeyed; a payload that is not JSON,
// or a field that is an object or array, is an error.
func JSONField(path ...string) KeyFunc {
	return func(e event.Event) (string, error) {
		ev, err := ParsePubSub(e)
		if err != nil {
			return "", err
		}
		dec := json.NewDecoder(bytes.NewReader(ev.Message.Data))
		dec.UseNumber()
		var v any
		if err := dec.Decode(&v); err != nil {
			return "", fmt.Errorf("%w: message %q payload is not JSON: %v", ErrMalformedEvent, ev.Message.ID, err)
		}
		for _, p := range path {
			obj, ok := v.(map[string]any)
			if !ok {
				return "", nil
			}
			if v, ok = obj[p]; !ok {
				return "", nil
			}
		}
		what := fmt.Sprintf("key field %q", path)
		switch x := v.(type) {
		case nil:
			return "", nil
		case string:
			return checkedKey(x, what, e)
		case json.Number:
			return checkedKey(x.String(), what, e)
		case bool:
			return strconv.FormatBool(x), nil
		}
		return "", fmt.Errorf("idempotency: key field %q of message %q is a %T, not a scalar", path, ev.Message.ID, v)
	}
}
