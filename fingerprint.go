package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// ErrPayloadMismatch reports a delivery whose key was already completed
// with a different payload: not a duplicate, and not run. [Lock] returns
// it as a *[PayloadMismatchError]; [Idempotent] and [PushHandler] nack
// the delivery with a 409, so that it reaches the subscription's
// dead-letter topic instead of being acked as a duplicate and lost.
var ErrPayloadMismatch = errors.New("idempotency: payload mismatch")

// PayloadMismatchError is the error [Lock] returns when the key was
// completed within its ttl by a payload whose fingerprint differs from
// this call's. errors.Is(err, ErrPayloadMismatch) reports true for it;
// errors.Is(err, ErrDuplicate) reports false.
type PayloadMismatchError struct {
	// Key is the completed key.
	Key string
	// Stored is the fingerprint of the payload that completed the key.
	Stored string
	// Delivered is the fingerprint of this call's payload.
	Delivered string
	// Until is when the completed record expires (and the key can run
	// again); zero when the backend does not say.
	Until time.Time
}

// Error names the key, and neither fingerprint: [PushHandler] and the
// functions framework write it as the 409's body, and the stored
// fingerprint, an unsalted hash of an earlier payload, would let whoever
// can post to the endpoint confirm a guess of that payload. The
// fingerprints are in Stored and Delivered, and in the ERROR line that
// [Idempotent] and PushHandler log.
func (e *PayloadMismatchError) Error() string {
	return fmt.Sprintf("idempotency: payload mismatch: key %q was completed by a different payload; not a duplicate, not run", e.Key)
}

// Is reports whether target is ErrPayloadMismatch.
func (e *PayloadMismatchError) Is(target error) bool { return target == ErrPayloadMismatch }

// FingerprintFunc computes the fingerprint of an event's payload, which
// [Idempotent] stores with the key when the handler succeeds, and compares
// with the stored one when a later delivery finds the key done. It must
// give every delivery of one message the same fingerprint, and different
// payloads different ones. An empty fingerprint with a nil error means
// none: the delivery is not compared, and completes without one. A
// non-nil error nacks the delivery before anything is claimed (a 400 when
// it wraps [ErrMalformedEvent], else a 500). A fingerprint must pass
// [store.ValidateFingerprint] (at most [store.MaxFingerprintLen] bytes of
// UTF-8 without NUL); one that does not nacks the delivery with a 500.
//
// Two fingerprints are compared only when they share a scheme, the text
// before their last colon (the whole of a fingerprint without one): a
// record completed under another FingerprintFunc, or under
// [PayloadFingerprint] with other attributes, is a plain duplicate, so
// that changing the function never turns pending redeliveries into
// mismatches. A FingerprintFunc of your own should start its
// fingerprints with a scheme of its own, such as "orders-v1:".
type FingerprintFunc func(e event.Event) (string, error)

// The schemes of PayloadFingerprint's fingerprints.
const (
	// DataFingerprintScheme starts the fingerprint PayloadFingerprint()
	// gives, over the message data alone: "data-sha256:" and 32 lowercase
	// hex digits (the first 128 bits of the SHA-256).
	DataFingerprintScheme = "data-sha256"
	// attrsFingerprintScheme starts a fingerprint over the data and
	// attributes, followed by "." and 8 hex digits naming the attribute
	// set.
	attrsFingerprintScheme = "data+attrs-sha256"
	// fieldsFingerprintScheme starts a fingerprint over chosen JSON
	// fields of the data, followed by "." and 8 hex digits naming the
	// set of fields.
	fieldsFingerprintScheme = "fields-sha256"
)

// fingerprintHexLen is how many hex digits of the SHA-256 a fingerprint
// keeps: 128 bits, ample to tell two payloads of one key apart.
const fingerprintHexLen = 32

// defaultFingerprint is Idempotent's default FingerprintFunc.
var defaultFingerprint = PayloadFingerprint()

// PayloadFingerprint returns a [FingerprintFunc] over a Pub/Sub message:
// the SHA-256 of its data (as published, base64-decoded), and of the named
// attributes when some are named, with a scheme that says which:
//
//	PayloadFingerprint()           data-sha256:<32 hex>
//	PayloadFingerprint("a", "b")   data+attrs-sha256.<8 hex>:<32 hex>
//
// where the 8 hex digits name the set of attributes (in any order). An
// attribute absent from the message and one present with an empty value
// are told apart. The data is the message's bytes, whatever shape the
// delivery came in (an Eventarc binary or structured CloudEvent, a raw
// push envelope through the functions framework or [PushHandler], an
// unwrapped push), so every redelivery of one message has one
// fingerprint. An event whose data is not a Pub/Sub message envelope has
// none (the empty fingerprint): it is not compared.
//
// PayloadFingerprint() is [Idempotent]'s default. Attributes are not in
// it because a republish of the same payload may carry attributes of its
// own: Pub/Sub client libraries can add per-publish attributes (an
// OpenTelemetry trace context, for one), which would make a producer's
// second publish of the same order look like a changed payload. Name only
// attributes that belong to the payload. On an unwrapped push
// ([WithUnwrappedPush]) only the attributes that option names reach the
// event: name the fingerprint's attributes there too, or a wrapped and an
// unwrapped delivery of one message will differ.
func PayloadFingerprint(attributes ...string) FingerprintFunc {
	if len(attributes) == 0 {
		return dataFingerprint
	}
	names := slices.Clone(attributes)
	slices.Sort(names)
	names = slices.Compact(names)
	set := sha256.New()
	for _, n := range names {
		writeField(set, n)
	}
	scheme := attrsFingerprintScheme + "." + hex.EncodeToString(set.Sum(nil)[:4])
	return func(e event.Event) (string, error) {
		var w struct {
			Message *struct {
				Data       []byte            `json:"data"`
				Attributes map[string]string `json:"attributes"`
			} `json:"message"`
		}
		if json.Unmarshal(e.Data(), &w) != nil || w.Message == nil {
			return "", nil
		}
		h := sha256.New()
		writeField(h, string(w.Message.Data))
		for _, n := range names {
			v, ok := w.Message.Attributes[n]
			if !ok {
				h.Write([]byte{0})
				continue
			}
			h.Write([]byte{1})
			writeField(h, v)
		}
		var sum [sha256.Size]byte
		return fingerprintString(scheme, h.Sum(sum[:0])), nil
	}
}

// JSONFieldsFingerprint returns a [FingerprintFunc] over chosen fields of
// a Pub/Sub message's JSON payload, each a path as [JSONField] takes it:
// JSONFieldsFingerprint([]string{"order", "qty"}, []string{"order",
// "price"}) compares the quantity and the price of an order and nothing
// else, so that a republish whose other fields changed (a send timestamp)
// stays a duplicate. Its fingerprints are
//
//	fields-sha256.<8 hex>:<32 hex>
//
// where the 8 hex digits name the set of paths (in any order), and the 32
// the first 128 bits of a SHA-256 over each field's value. A value is read
// for what it means, not how it is written: white space, and the order of
// an object's members, do not count, and of two members with one name the
// last counts; a string counts by its characters (so "\u0041" is "A"); a
// number counts by its text as written (1 and 1.0 differ, as in
// JSONField's keys). Any other change of a chosen field (its type, a
// character, an element of an array, a member of an object, null, or its
// absence) changes the fingerprint.
//
// An event whose data is not a Pub/Sub message envelope has none (the
// empty fingerprint), as with [PayloadFingerprint]. These are the
// message's fault, an error wrapping [ErrMalformedEvent] that names the
// field (a 400 from [Idempotent] and [PushHandler], before anything is
// claimed): a payload that is not exactly one JSON value, and a chosen
// field holding a string (a member name included) with bytes that are not
// UTF-8 or a \u escape of a lone UTF-16 surrogate, which a decoder turns
// into U+FFFD so that two different payloads would share a fingerprint.
// JSONFieldsFingerprint panics without paths.
func JSONFieldsFingerprint(paths ...[]string) FingerprintFunc {
	if len(paths) == 0 {
		panic("idempotency: JSONFieldsFingerprint needs at least one field")
	}
	sorted := make([][]string, len(paths))
	for i, p := range paths {
		sorted[i] = slices.Clone(p)
	}
	slices.SortFunc(sorted, slices.Compare)
	sorted = slices.CompactFunc(sorted, slices.Equal)
	set := sha256.New()
	for _, p := range sorted {
		writeField(set, strconv.Itoa(len(p)))
		for _, name := range p {
			writeField(set, name)
		}
	}
	scheme := fieldsFingerprintScheme + "." + hex.EncodeToString(set.Sum(nil)[:4])
	tree := newFieldTree(sorted)
	return func(e event.Event) (string, error) {
		var w struct {
			Message *struct {
				MessageID    string `json:"messageId"`
				MessageIDAlt string `json:"message_id"`
				Data         []byte `json:"data"`
			} `json:"message"`
		}
		if json.Unmarshal(e.Data(), &w) != nil || w.Message == nil {
			return "", nil
		}
		id := firstNonEmpty(w.Message.MessageID, w.Message.MessageIDAlt)
		raws, err := tree.values(w.Message.Data)
		if err != nil {
			return "", fmt.Errorf("%w: fingerprint field %q of message %q: %v", ErrMalformedEvent, sorted[0], id, err)
		}
		h := sha256.New()
		for i, raw := range raws {
			if raw == nil {
				h.Write([]byte{0})
				continue
			}
			h.Write([]byte{1})
			if err := checkJSONString(raw); err != nil {
				return "", fmt.Errorf("%w: fingerprint field %q of message %q %v", ErrMalformedEvent, sorted[i], id, err)
			}
			if err := writeCanonicalJSON(h, raw); err != nil {
				return "", fmt.Errorf("%w: fingerprint field %q of message %q: %v", ErrMalformedEvent, sorted[i], id, err)
			}
		}
		var sum [sha256.Size]byte
		return fingerprintString(scheme, h.Sum(sum[:0])), nil
	}
}

// writeCanonicalJSON writes the valid JSON value raw to h as a tagged,
// length-prefixed encoding of what it means, so that two values write the
// same bytes exactly when they differ only in white space, member order or
// repeated member names (the last counts), or in how a string's characters
// are escaped.
func writeCanonicalJSON(h interface{ Write([]byte) (int, error) }, raw json.RawMessage) error {
	raw = bytes.TrimSpace(raw)
	var count [8]byte
	switch raw[0] {
	case '{':
		var obj map[string]json.RawMessage
		if err := json.Unmarshal(raw, &obj); err != nil {
			return err
		}
		h.Write([]byte{'o'})
		binary.BigEndian.PutUint64(count[:], uint64(len(obj)))
		h.Write(count[:])
		for _, name := range slices.Sorted(maps.Keys(obj)) {
			writeField(h, name)
			if err := writeCanonicalJSON(h, obj[name]); err != nil {
				return err
			}
		}
	case '[':
		var arr []json.RawMessage
		if err := json.Unmarshal(raw, &arr); err != nil {
			return err
		}
		h.Write([]byte{'a'})
		binary.BigEndian.PutUint64(count[:], uint64(len(arr)))
		h.Write(count[:])
		for _, v := range arr {
			if err := writeCanonicalJSON(h, v); err != nil {
				return err
			}
		}
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return err
		}
		h.Write([]byte{'s'})
		writeField(h, s)
	case 'n', 't', 'f':
		h.Write(raw[:1]) // null, true, false
	default:
		h.Write([]byte{'d'})
		writeField(h, string(raw)) // a number, as written
	}
	return nil
}

// writeField writes s, prefixed with its length, so that no two lists of
// fields hash alike.
func writeField(h interface{ Write([]byte) (int, error) }, s string) {
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(s)))
	h.Write(n[:])
	h.Write([]byte(s))
}

// dataFingerprint is PayloadFingerprint(): the SHA-256 of the message data,
// as a decode with encoding/json of the envelope into a []byte data field
// gives it (none when that decode fails or finds no message object), but
// without holding the decoded data: dataDigest hashes it as it is decoded.
func dataFingerprint(e event.Event) (string, error) {
	var w struct {
		Message *struct {
			Data dataDigest `json:"data"`
		} `json:"message"`
	}
	if json.Unmarshal(e.Data(), &w) != nil || w.Message == nil {
		return "", nil
	}
	sum := w.Message.Data.sum()
	return fingerprintString(DataFingerprintScheme, sum[:]), nil
}

// keyAndFingerprint resolves e's key under c and, when it can in the same
// pass, e's fingerprint (fpDone). Under the default key and fingerprint,
// one decode of the envelope serves both (what each would decode alone).
// Whatever that decode does not answer (malformed data, invalid base64,
// no message object) goes to each function alone, so the outcome, and
// each error, is theirs: then fpDone is false and the caller calls
// c.fingerprintOf.
func (c *config) keyAndFingerprint(e event.Event) (key, fp string, fpDone bool, err error) {
	byMessageID := sameFunc(c.key, messageID) || (sameFunc(c.key, defaultKey) && e.Type() == PubSubEventType)
	if c.fingerprint != nil && byMessageID && sameFunc(c.fingerprint, dataFingerprint) {
		var w struct {
			Message *struct {
				MessageID    string     `json:"messageId"`
				MessageIDAlt string     `json:"message_id"`
				Data         dataDigest `json:"data"`
			} `json:"message"`
		}
		if json.Unmarshal(e.Data(), &w) == nil && w.Message != nil {
			key, err = messageIDKey(w.Message.MessageID, w.Message.MessageIDAlt, e)
			if !sameFunc(c.key, messageID) {
				key, err = escapedMessageKey(e, key, err)
			}
			sum := w.Message.Data.sum()
			return key, fingerprintString(DataFingerprintScheme, sum[:]), true, err
		}
	}
	key, err = c.key(e)
	return key, "", false, err
}

// sameFunc reports whether f is the top-level function g (not a closure).
func sameFunc[F ~func(event.Event) (string, error)](f F, g func(event.Event) (string, error)) bool {
	return reflect.ValueOf(f).Pointer() == reflect.ValueOf(g).Pointer()
}

// dataDigest is the SHA-256 of a []byte field as encoding/json decodes it
// (a base64 string; null, like an absent field, is empty), without keeping
// the bytes. Its UnmarshalJSON fails where encoding/json fails to decode
// the value into a []byte, so the decode it is part of fails as that one
// would; it decodes the common case, a string without escapes, a block at
// a time, and anything else through encoding/json itself.
type dataDigest struct {
	digest [sha256.Size]byte
	set    bool // digest holds the value's; else the data is empty
}

func (d *dataDigest) sum() [sha256.Size]byte {
	if !d.set {
		return sha256.Sum256(nil)
	}
	return d.digest
}

// UnmarshalJSON hashes the []byte that encoding/json would decode from b.
func (d *dataDigest) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*d = dataDigest{}
		return nil
	}
	if len(b) >= 2 && b[0] == '"' && bytes.IndexByte(b, '\\') < 0 {
		// The exact base64 text (JSON allows no raw control bytes in a
		// string, so no newline that base64 would skip).
		sum, ok := sumBase64(b[1 : len(b)-1])
		if !ok {
			return errors.New("idempotency: message data is not valid base64")
		}
		*d = dataDigest{digest: sum, set: true}
		return nil
	}
	var data []byte // an escaped string, or an array of bytes: rare
	if err := json.Unmarshal(b, &data); err != nil {
		return err
	}
	*d = dataDigest{digest: sha256.Sum256(data), set: true}
	return nil
}

// sumBase64 is the SHA-256 of the bytes that standard base64 text b64
// decodes to, as encoding/json decodes a []byte, decoded a block at a
// time; false when b64 is not valid base64.
func sumBase64(b64 []byte) ([sha256.Size]byte, bool) {
	var sum [sha256.Size]byte
	const block = 4096 // base64 characters, a multiple of 4
	var buf [block / 4 * 3]byte
	if len(b64) <= block {
		n, err := base64.StdEncoding.Decode(buf[:], b64)
		if err != nil {
			return sum, false
		}
		return sha256.Sum256(buf[:n]), true
	}
	h := sha256.New()
	for len(b64) > 0 {
		chunk := b64[:min(block, len(b64))]
		b64 = b64[len(chunk):]
		n, err := base64.StdEncoding.Decode(buf[:], chunk)
		// Padding may end only the last block: a block that ends in it
		// decodes alone, but the whole text is not valid base64.
		if err != nil || len(b64) > 0 && chunk[len(chunk)-1] == '=' {
			return sum, false
		}
		h.Write(buf[:n])
	}
	h.Sum(sum[:0])
	return sum, true
}

// fingerprintString is scheme, a colon, and the first fingerprintHexLen
// hex digits of sum, in one allocation.
func fingerprintString(scheme string, sum []byte) string {
	var b strings.Builder
	b.Grow(len(scheme) + 1 + fingerprintHexLen)
	b.WriteString(scheme)
	b.WriteByte(':')
	var digits [fingerprintHexLen]byte
	hex.Encode(digits[:], sum[:fingerprintHexLen/2])
	b.Write(digits[:])
	return b.String()
}

// fingerprintScheme is the text of fp before its last colon.
func fingerprintScheme(fp string) string {
	if i := strings.LastIndexByte(fp, ':'); i >= 0 {
		return fp[:i]
	}
	return fp
}

// mismatch reports whether a delivery with fingerprint delivered differs
// from the payload that completed the key with fingerprint stored: both
// known, of one scheme, and different.
func mismatch(stored, delivered string) bool {
	return stored != "" && delivered != "" && stored != delivered &&
		fingerprintScheme(stored) == fingerprintScheme(delivered)
}

// WithFingerprint sets how [Idempotent] and [PushHandler] fingerprint a
// delivery's payload (see [FingerprintFunc]); nil turns fingerprints off,
// and a delivery whose key is done is then a duplicate whatever its
// payload. The default is [PayloadFingerprint](), over the message data.
//
// The fingerprint is stored with the key when the handler succeeds, on a
// backend that implements [store.Fingerprinter] (all of this module's
// do). A later delivery of the key within its ttl whose fingerprint
// differs is not a duplicate: the handler does not run, an ERROR log
// names the key and both fingerprints, and the delivery is nacked with a
// 409 (an error wrapping [ErrPayloadMismatch], whose body carries no
// fingerprint: see [PayloadMismatchError.Error]), so that it reaches the
// dead-letter topic instead of being acked and lost. A record completed
// without a fingerprint (before fingerprints, or with them off) keeps
// acking duplicates as before. On a backend that does not implement
// store.Fingerprinter, nothing is stored and nothing compared: Idempotent
// logs a warning once, when it is called.
func WithFingerprint(f FingerprintFunc) Option {
	return option(func(c *config) { c.fingerprint = f })
}

// WithPayloadFingerprint gives [Lock] the fingerprint of the payload its
// body works on: Lock stores it with the key when the body succeeds (on a
// backend that implements [store.Fingerprinter]), and when it finds the
// key completed by a payload of another fingerprint (of the same scheme;
// see [FingerprintFunc]), it returns a *[PayloadMismatchError] instead of
// a duplicate, without running the body. An empty fp means none. A
// fingerprint that [store.ValidateFingerprint] refuses makes Lock return
// an error wrapping [store.ErrInvalidFingerprint] before it claims. [Mutex]
// ignores it (it never completes), and so do [Idempotent] and
// [PushHandler], which fingerprint each delivery with [WithFingerprint]'s
// function.
func WithPayloadFingerprint(fp string) LockOption {
	return lockOption(func(c *lockConfig) { c.fingerprint = fp })
}

// fingerprintOf is the fingerprint of e under c, validated.
func (c *config) fingerprintOf(e event.Event) (string, error) {
	if c.fingerprint == nil {
		return "", nil
	}
	fp, err := c.fingerprint(e)
	if err != nil {
		return "", fmt.Errorf(errPrefix+" event %q: fingerprinting the payload: %w", e.ID(), err)
	}
	if err := store.ValidateFingerprint(fp); err != nil {
		return "", fmt.Errorf(errPrefix+" event %q: the FingerprintFunc's fingerprint: %w", e.ID(), err)
	}
	return fp, nil
}
