package idempotency

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/cloudevents/sdk-go/v2/event"
)

// decodedIDs is what encoding/json makes of data for the default key: the
// reference scanMessageIDs must agree with wherever it answers.
func decodedIDs(data []byte) (id, alt string, ok bool) {
	var w struct {
		Message *struct {
			MessageID    string `json:"messageId"`
			MessageIDAlt string `json:"message_id"`
		} `json:"message"`
	}
	if json.Unmarshal(data, &w) != nil || w.Message == nil {
		return "", "", false
	}
	return w.Message.MessageID, w.Message.MessageIDAlt, true
}

// pubsubEvent is a Pub/Sub CloudEvent with id ceID and data.
func pubsubEvent(ceID string, data []byte) event.Event {
	e := event.New()
	e.SetID(ceID)
	e.SetType(PubSubEventType)
	e.SetSource("//pubsub.googleapis.com/projects/p/topics/t")
	e.SetData("application/json", data)
	return e
}

// referenceKey is the default key computed by encoding/json alone.
func referenceKey(e event.Event) (string, error) {
	id, alt, err := decodeMessageIDs(e)
	if err != nil {
		return "", err
	}
	id = firstNonEmpty(id, alt)
	if id == "" && e.Type() == PubSubEventType {
		id = e.ID()
	}
	return checkedKey(id, "messageId", e)
}

// sameKey fails t unless MessageID and the encoding/json reference give e
// the same key, or errors with the same text and sentinels.
func sameKey(t testing.TB, e event.Event) {
	t.Helper()
	got, gerr := MessageID()(e)
	want, werr := referenceKey(e)
	if got != want || (gerr == nil) != (werr == nil) {
		t.Fatalf("data %q: key %q, %v; encoding/json gives %q, %v", e.Data(), got, gerr, want, werr)
	}
	if gerr != nil && (gerr.Error() != werr.Error() ||
		errors.Is(gerr, ErrMalformedEvent) != errors.Is(werr, ErrMalformedEvent)) {
		t.Fatalf("data %q: error %v; encoding/json gives %v", e.Data(), gerr, werr)
	}
}

// scanCases are envelopes whose key is easy to get wrong, and whether the
// scan answers them itself (fast) or leaves them to encoding/json.
var scanCases = []struct {
	name string
	data string
	fast bool
}{
	{"eventarc", `{"message":{"attributes":{"po_id":"PO-1"},"data":"eyJ9","messageId":"m1","message_id":"m1","publishTime":"2026-11-29T12:00:00Z"},"subscription":"projects/p/subscriptions/s","deliveryAttempt":1}`, true},
	{"raw push, snake case only", `{"message":{"data":"eyJ9","message_id":"m2"},"subscription":"s"}`, true},
	{"camel case only", `{"message":{"messageId":"m3"}}`, true},
	{"camel case wins over snake case", `{"message":{"message_id":"snake","messageId":"camel"}}`, true},
	{"empty camel falls back to snake", `{"message":{"messageId":"","message_id":"snake"}}`, true},
	{"no id: the CloudEvent id", `{"message":{"data":"eyJ9"}}`, true},
	{"last duplicate id wins", `{"message":{"messageId":"first","messageId":"second"}}`, true},
	{"null id keeps the earlier one", `{"message":{"messageId":"kept","messageId":null}}`, true},
	{"ids match ignoring case", `{"MESSAGE":{"MessageID":"upper","Message_Id":"alt"}}`, true},
	{"second message object adds to the first", `{"message":{"messageId":"a"},"message":{"message_id":"b"}}`, true},
	{"second message object overrides", `{"message":{"messageId":"a"},"message":{"messageId":"b"}}`, true},
	{"null message drops the first", `{"message":{"messageId":"a"},"message":null,"message":{"message_id":"b"}}`, true},
	{"null message last", `{"message":{"messageId":"a"},"message":null}`, false},
	{"id inside data is not the id", `{"data":{"messageId":"no"},"message":{"attributes":{"messageId":"no"},"data":"eyJ9"}}`, true},
	{"nested message objects are not the message", `{"subscription":{"message":{"messageId":"no"}},"message":{"x":[{"messageId":"no"}],"messageId":"yes"}}`, true},
	{"data shapes", `{"message":{"data":[1,-2.5e+3,true,false,null,"s",{"a":[]},[],{}],"messageId":"shapes"}}`, true},
	{"whitespace everywhere", " \t\r\n{ \"message\" : { \"messageId\" : \"ws\" } , \"deliveryAttempt\" : 2 } \n", true},
	{"unicode id", `{"message":{"messageId":"zürich-東京"}}`, true},
	{"escaped id", `{"message":{"messageId":"a\"b\u00e9\n"}}`, false},
	{"escaped key", `{"message":{"message\u0049d":"escaped-key"}}`, false},
	{"escaped message key", `{"mess\u0061ge":{"messageId":"x"}}`, false},
	{"kelvin-folded key", "{\"message\":{\"messageId\":\"a\",\"\u212aey\":1}}", false},
	{"long-s key folds to message", "{\"me\u017f\u017fage\":{\"messageId\":\"fold\"}}", false},
	{"escaped string elsewhere", `{"message":{"attributes":{"k\"":"v\\\u0041"},"messageId":"esc-elsewhere"}}`, true},
	{"non-ASCII key elsewhere", `{"message":{"attributes":{"clé":"v"},"messageId":"nonascii-elsewhere"}}`, true},
	{"numeric id", `{"message":{"messageId":12}}`, false},
	{"object id", `{"message":{"messageId":{}}}`, false},
	{"message is a string", `{"message":"m"}`, false},
	{"message is an array", `{"message":[]}`, false},
	{"no message", `{"subscription":"s"}`, false},
	{"top level array", `[{"message":{"messageId":"a"}}]`, false},
	{"top level null", `null`, false},
	{"empty", ``, false},
	{"trailing garbage", `{"message":{"messageId":"a"}}x`, false},
	{"two values", `{"message":{"messageId":"a"}} {}`, false},
	{"trailing comma", `{"message":{"messageId":"a"},}`, false},
	{"bad number elsewhere", `{"message":{"messageId":"a","n":01}}`, false},
	{"bad literal elsewhere", `{"message":{"messageId":"a","t":tru}}`, false},
	{"control byte in a string", "{\"message\":{\"messageId\":\"a\",\"x\":\"\x01\"}}", false},
	{"invalid UTF-8 in the id", "{\"message\":{\"messageId\":\"a\xffb\"}}", false},
	{"invalid UTF-8 elsewhere", "{\"message\":{\"messageId\":\"a\",\"x\":\"\xff\"}}", true},
	{"byte order mark", "\xef\xbb\xbf{\"message\":{\"messageId\":\"a\"}}", false},
	{"deep data", `{"message":{"messageId":"deep","data":` + strings.Repeat("[", 200) + strings.Repeat("]", 200) + `}}`, false},
	{"unclosed", `{"message":{"messageId":"a"}`, false},
	{"id refused by the port", "{\"message\":{\"messageId\":\"" + strings.Repeat("k", 2000) + "\"}}", true},
}

// TestMessageIDScanGivesTheDecodedKey pins that the default key's fast
// path gives each envelope the key (or the refusal) encoding/json gives
// it: duplicate keys, both spellings, escapes, case, data shapes, and
// malformed data, and that the scan answers the common shapes itself.
func TestMessageIDScanGivesTheDecodedKey(t *testing.T) {
	for _, c := range scanCases {
		t.Run(c.name, func(t *testing.T) {
			data := []byte(c.data)
			id, alt, ok := scanMessageIDs(data)
			if ok != c.fast {
				t.Fatalf("scan answered %v, want %v", ok, c.fast)
			}
			if ok {
				wid, walt, wok := decodedIDs(data)
				if !wok || id != wid || alt != walt {
					t.Fatalf("scan: %q, %q; encoding/json: %q, %q (decoded %v)", id, alt, wid, walt, wok)
				}
			}
			sameKey(t, pubsubEvent("ce-id", data))
			other := pubsubEvent("ce-id", data)
			other.SetType("com.example.other")
			sameKey(t, other)
		})
	}
}

// FuzzMessageIDScan compares the default key's fast path with encoding/json
// on arbitrary data: where the scan answers, the decode must succeed with
// the same ids, and MessageID must give every input the reference key or
// error.
func FuzzMessageIDScan(f *testing.F) {
	for _, c := range scanCases {
		f.Add([]byte(c.data))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if id, alt, ok := scanMessageIDs(data); ok {
			wid, walt, wok := decodedIDs(data)
			if !wok || id != wid || alt != walt {
				t.Fatalf("data %q: scan %q, %q; encoding/json %q, %q (decoded %v)", data, id, alt, wid, walt, wok)
			}
		}
		sameKey(t, pubsubEvent("ce-id", data))
	})
}
