package idempotency

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// pubsubEvent is a Pub/Sub CloudEvent with id ceID and data.
func pubsubEvent(ceID string, data []byte) event.Event {
	e := event.New()
	e.SetID(ceID)
	e.SetType(PubSubEventType)
	e.SetSource("//pubsub.googleapis.com/projects/p/topics/t")
	e.SetData("application/json", data)
	return e
}

// Outcomes of the default key beside its key.
const (
	malformed = "<ErrMalformedEvent>"
	refusedID = "<store.ErrInvalidKey>"
)

// envelopeCases are envelopes whose default key is easy to get wrong, with
// the key MessageID gives a Pub/Sub event of CloudEvent id "ce-id" and an
// event of another type: encoding/json's reading of the envelope (these
// are the cases the hand-written scan that preceded it was checked on).
var envelopeCases = []struct {
	name, data    string
	pubsub, other string
}{
	{"eventarc", `{"message":{"attributes":{"po_id":"PO-1"},"data":"eyJ9","messageId":"m1","message_id":"m1","publishTime":"2026-11-29T12:00:00Z"},"subscription":"projects/p/subscriptions/s","deliveryAttempt":1}`, "m1", "m1"},
	{"raw push, snake case only", `{"message":{"data":"eyJ9","message_id":"m2"},"subscription":"s"}`, "m2", "m2"},
	{"camel case only", `{"message":{"messageId":"m3"}}`, "m3", "m3"},
	{"camel case wins over snake case", `{"message":{"message_id":"snake","messageId":"camel"}}`, "camel", "camel"},
	{"empty camel falls back to snake", `{"message":{"messageId":"","message_id":"snake"}}`, "snake", "snake"},
	{"no id: the CloudEvent id", `{"message":{"data":"eyJ9"}}`, "ce-id", ""},
	{"last duplicate id wins", `{"message":{"messageId":"first","messageId":"second"}}`, "second", "second"},
	{"null id keeps the earlier one", `{"message":{"messageId":"kept","messageId":null}}`, "kept", "kept"},
	{"ids match ignoring case", `{"MESSAGE":{"MessageID":"upper","Message_Id":"alt"}}`, "upper", "upper"},
	{"second message object adds to the first", `{"message":{"messageId":"a"},"message":{"message_id":"b"}}`, "a", "a"},
	{"second message object overrides", `{"message":{"messageId":"a"},"message":{"messageId":"b"}}`, "b", "b"},
	{"null message drops the first", `{"message":{"messageId":"a"},"message":null,"message":{"message_id":"b"}}`, "b", "b"},
	{"null message last", `{"message":{"messageId":"a"},"message":null}`, malformed, malformed},
	{"id inside data is not the id", `{"data":{"messageId":"no"},"message":{"attributes":{"messageId":"no"},"data":"eyJ9"}}`, "ce-id", ""},
	{"nested message objects are not the message", `{"subscription":{"message":{"messageId":"no"}},"message":{"x":[{"messageId":"no"}],"messageId":"yes"}}`, "yes", "yes"},
	{"data shapes", `{"message":{"data":[1,-2.5e+3,true,false,null,"s",{"a":[]},[],{}],"messageId":"shapes"}}`, "shapes", "shapes"},
	{"whitespace everywhere", " \t\r\n{ \"message\" : { \"messageId\" : \"ws\" } , \"deliveryAttempt\" : 2 } \n", "ws", "ws"},
	{"unicode id", `{"message":{"messageId":"zürich-東京"}}`, "zürich-東京", "zürich-東京"},
	{"escaped id", `{"message":{"messageId":"a\"b\u00e9\n"}}`, "a\"bé\n", "a\"bé\n"},
	{"escaped key", `{"message":{"message\u0049d":"escaped-key"}}`, "escaped-key", "escaped-key"},
	{"escaped message key", `{"mess\u0061ge":{"messageId":"x"}}`, "x", "x"},
	{"kelvin-folded key", "{\"message\":{\"messageId\":\"a\",\"\u212aey\":1}}", "a", "a"},
	{"long-s key folds to message", "{\"me\u017f\u017fage\":{\"messageId\":\"fold\"}}", "fold", "fold"},
	{"escaped string elsewhere", `{"message":{"attributes":{"k\"":"v\\\u0041"},"messageId":"esc-elsewhere"}}`, "esc-elsewhere", "esc-elsewhere"},
	{"non-ASCII key elsewhere", `{"message":{"attributes":{"clé":"v"},"messageId":"nonascii-elsewhere"}}`, "nonascii-elsewhere", "nonascii-elsewhere"},
	{"numeric id", `{"message":{"messageId":12}}`, malformed, malformed},
	{"object id", `{"message":{"messageId":{}}}`, malformed, malformed},
	{"message is a string", `{"message":"m"}`, malformed, malformed},
	{"message is an array", `{"message":[]}`, malformed, malformed},
	{"no message", `{"subscription":"s"}`, malformed, malformed},
	{"top level array", `[{"message":{"messageId":"a"}}]`, malformed, malformed},
	{"top level null", `null`, malformed, malformed},
	{"empty", ``, malformed, malformed},
	{"trailing garbage", `{"message":{"messageId":"a"}}x`, malformed, malformed},
	{"two values", `{"message":{"messageId":"a"}} {}`, malformed, malformed},
	{"trailing comma", `{"message":{"messageId":"a"},}`, malformed, malformed},
	{"bad number elsewhere", `{"message":{"messageId":"a","n":01}}`, malformed, malformed},
	{"bad literal elsewhere", `{"message":{"messageId":"a","t":tru}}`, malformed, malformed},
	{"control byte in a string", "{\"message\":{\"messageId\":\"a\",\"x\":\"\x01\"}}", malformed, malformed},
	{"invalid UTF-8 in the id", "{\"message\":{\"messageId\":\"a\xffb\"}}", "a\ufffdb", "a\ufffdb"},
	{"invalid UTF-8 elsewhere", "{\"message\":{\"messageId\":\"a\",\"x\":\"\xff\"}}", "a", "a"},
	{"byte order mark", "\xef\xbb\xbf{\"message\":{\"messageId\":\"a\"}}", malformed, malformed},
	{"deep data", `{"message":{"messageId":"deep","data":` + strings.Repeat("[", 200) + strings.Repeat("]", 200) + `}}`, "deep", "deep"},
	{"unclosed", `{"message":{"messageId":"a"}`, malformed, malformed},
	{"id refused by the port", "{\"message\":{\"messageId\":\"" + strings.Repeat("k", 2000) + "\"}}", refusedID, refusedID},
}

// TestMessageIDReadsTheEnvelopeAsEncodingJSON pins the default key of
// each envelope: duplicate keys (the last wins), both spellings, escapes,
// case folding, a second message object, a null one, data shapes, and
// malformed data.
func TestMessageIDReadsTheEnvelopeAsEncodingJSON(t *testing.T) {
	for _, c := range envelopeCases {
		t.Run(c.name, func(t *testing.T) {
			for _, typ := range []string{PubSubEventType, "com.example.other"} {
				e := pubsubEvent("ce-id", []byte(c.data))
				e.SetType(typ)
				want := c.pubsub
				if typ != PubSubEventType {
					want = c.other
				}
				got, err := MessageID()(e)
				switch {
				case want == malformed:
					if !errors.Is(err, ErrMalformedEvent) {
						t.Fatalf("%s: key %q, %v; want ErrMalformedEvent", typ, got, err)
					}
				case want == refusedID:
					if !errors.Is(err, store.ErrInvalidKey) {
						t.Fatalf("%s: key %q, %v; want store.ErrInvalidKey", typ, got, err)
					}
				case err != nil || got != want:
					t.Fatalf("%s: key %q, %v; want %q", typ, got, err, want)
				}
				ev, perr := ParsePubSub(e)
				if err == nil && perr == nil && ev.Message.ID != got {
					t.Fatalf("%s: ParsePubSub's ID %q, %v; MessageID's key %q", typ, ev.Message.ID, perr, got)
				}
			}
		})
	}
}

// decodedDataFingerprint is the documented rule for the default
// fingerprint, decoded the plain way: the SHA-256 of the message data as
// encoding/json decodes the envelope into a []byte, none when that decode
// fails or finds no message object.
func decodedDataFingerprint(data []byte) string {
	var w struct {
		Message *struct {
			Data []byte `json:"data"`
		} `json:"message"`
	}
	if json.Unmarshal(data, &w) != nil || w.Message == nil {
		return ""
	}
	sum := sha256.Sum256(w.Message.Data)
	return fingerprintString(DataFingerprintScheme, sum[:])
}

// none marks an envelope that has no fingerprint.
const none = "<none>"

// fingerprintCases are envelopes whose data is easy to get wrong, with
// the data the default fingerprint hashes.
var fingerprintCases = []struct{ data, hashed string }{
	{`{"message":{"data":"aGVsbG8=","messageId":"1"}}`, "hello"},
	{`{"message":{"data":"aGVsbG8="},"message":{"messageId":"1"}}`, "hello"},                               // the second object adds to the first
	{`{"message":{"data":"aGVsbG8="},"message":null,"message":{}}`, ""},                                    // a null drops it
	{`{"message":{"data":"aGVsbG8=","DATA":"d29ybGQ="}}`, "world"},                                         // the last of keys that fold alike
	{`{"message":{"data":"aGVsbG8=","data":null}}`, ""},                                                    // null sets a []byte to nil
	{`{"message":{"data":""}}`, ""},                                                                        // empty
	{`{"message":{}}`, ""},                                                                                 // absent
	{`{"message":{"data":"aGVsbG8"}}`, none},                                                               // bad padding
	{`{"message":{"data":"aGVs\/bG8="}}`, none},                                                            // an escape; 9 characters, not base64
	{`{"message":{"data":"aGVs\/bG8"}}`, "hel\xfd\xb1\xbc"},                                                // an escaped slash
	{`{"message":{"data":"aGVsbG8\u003d"}}`, "hello"},                                                      // an escaped padding
	{`{"message":{"data":[104,105]}}`, "hi"},                                                               // encoding/json decodes an array of bytes too
	{`{"message":{"data":[256]}}`, none},                                                                   // not a byte
	{`{"message":{"data":12}}`, none},                                                                      // not a string
	{`{"message":"x"}`, none},                                                                              // not an object
	{`{"message":null}`, none},                                                                             // no message
	{`{"message":{"data":"aGVsbG8="}} x`, none},                                                            // trailing bytes
	{`{"message":{"data":"` + strings.Repeat("QUJD", 3000) + `"}}`, strings.Repeat("ABC", 3000)},           // over one block
	{`{"message":{"data":"` + strings.Repeat("QUJD", 1024) + `QQ=="}}`, strings.Repeat("ABC", 1024) + "A"}, // padding in the last block
	// padding that ends the first block, more data after it: encoding/json
	// refuses it (no fingerprint), so the block-wise decode must too
	{`{"message":{"data":"` + strings.Repeat("QUJD", 1023) + `QQ==QUJD"}}`, none},
	{`{"message":{"dat\u0061":"aGVsbG8="}}`, "hello"}, // an escaped key
	{`{"subscription":"s","message":{"attributes":{"data":"x"},"data":"aGVsbG8="}}`, "hello"},
	{"{\"message\":{\"data\":\"aGVs\xffbG8=\"}}", none}, // a byte that is not base64 (nor UTF-8)
	// Found by FuzzDataFingerprintScan (the hand-written scan): a repeated
	// data key whose earlier value is invalid fails the whole decode.
	{`{"messAge":{"dAtA":"0","DATA":""}}`, none},
	// Issue 23.4: an invalid data in a message object that a later null
	// drops still fails the decode, so there is no fingerprint (the scan
	// gave the fingerprint of empty data, and a 409).
	{`{"message":{"data":"!!!!"},"message":null,"message":{}}`, none},
	{`{"message":{"data":"aGVsbG8"},"message":null,"message":{"messageId":"m"}}`, none},
}

// TestDataFingerprintIsTheDecodedDatasHash pins the default fingerprint of
// each envelope: the SHA-256 of the data encoding/json decodes, or none,
// and that it agrees with decoding the data the plain way.
func TestDataFingerprintIsTheDecodedDatasHash(t *testing.T) {
	for _, c := range fingerprintCases {
		want := ""
		if c.hashed != none {
			sum := sha256.Sum256([]byte(c.hashed))
			want = fingerprintString(DataFingerprintScheme, sum[:])
		}
		sameFingerprint(t, []byte(c.data))
		if got, _ := dataFingerprint(pubsubEvent("ce", []byte(c.data))); got != want {
			t.Errorf("data %.80q: fingerprint %q, want %q (of %.20q)", c.data, got, want, c.hashed)
		}
	}
	fp, _ := dataFingerprint(pubsubEvent("ce", []byte(`{"message":{"data":"`+base64.StdEncoding.EncodeToString([]byte("hello"))+`"}}`)))
	if len(fp) != len("data-sha256:")+32 || !strings.HasPrefix(fp, "data-sha256:") {
		t.Fatalf("fingerprint %q: want data-sha256: and 32 hex digits", fp)
	}
}

// sameFingerprint fails unless the default fingerprint gives data the one
// the plain decode does.
func sameFingerprint(t testing.TB, data []byte) {
	t.Helper()
	got, err := dataFingerprint(pubsubEvent("ce", data))
	if err != nil {
		t.Fatalf("data %q: %v", data, err)
	}
	if want := decodedDataFingerprint(data); got != want {
		t.Fatalf("data %q: fingerprint %q, the plain decode gives %q", data, got, want)
	}
}

// FuzzDataFingerprint compares the default fingerprint, which hashes the
// data as encoding/json decodes it without keeping it, with the plain
// decode into a []byte, on arbitrary envelopes; and the default key with
// ParsePubSub's ID.
func FuzzDataFingerprint(f *testing.F) {
	for _, c := range fingerprintCases {
		f.Add([]byte(c.data))
	}
	for _, c := range envelopeCases {
		f.Add([]byte(c.data))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		sameFingerprint(t, data)
		e := pubsubEvent("ce", data)
		key, kerr := MessageID()(e)
		if ev, err := ParsePubSub(e); err == nil && kerr == nil && key != ev.Message.ID {
			t.Fatalf("data %q: key %q, ParsePubSub's ID %q", data, key, ev.Message.ID)
		}
	})
}
