package idempotency

import (
	"crypto/sha256"
	"encoding/base64"
	"strings"
	"testing"
)

// fingerprintCases are envelopes whose data is easy to get wrong.
var fingerprintCases = []string{
	`{"message":{"data":"aGVsbG8=","messageId":"1"}}`,
	`{"message":{"data":"aGVsbG8="},"message":{"messageId":"1"}}`,     // the second object adds to the first
	`{"message":{"data":"aGVsbG8="},"message":null,"message":{}}`,     // a null drops it
	`{"message":{"data":"aGVsbG8=","DATA":"d29ybGQ="}}`,               // the last of keys that fold alike
	`{"message":{"data":"aGVsbG8=","data":null}}`,                     // null sets a []byte to nil
	`{"message":{"data":""}}`,                                         // empty
	`{"message":{}}`,                                                  // absent
	`{"message":{"data":"aGVsbG8"}}`,                                  // bad padding: no fingerprint
	`{"message":{"data":"aGVs\/bG8="}}`,                               // an escape: left to encoding/json
	`{"message":{"data":12}}`,                                         // not a string
	`{"message":"x"}`,                                                 // not an object
	`{"message":{"data":"aGVsbG8="}} x`,                               // trailing bytes
	`{"message":{"data":"` + strings.Repeat("QUJD", 3000) + `"}}`,     // over one block
	`{"message":{"data":"` + strings.Repeat("QUJD", 1024) + `QQ=="}}`, // padding in the last block
	// padding that ends the first block, more data after it: encoding/json
	// refuses it (no fingerprint), so the block-wise decode must too
	`{"message":{"data":"` + strings.Repeat("QUJD", 1023) + `QQ==QUJD"}}`,
	`{"message":{"dat\u0061":"aGVsbG8="}}`, // an escaped key
	`{"subscription":"s","message":{"attributes":{"data":"x"},"data":"aGVsbG8="}}`,
}

// sameFingerprint fails unless the fast path gives data the fingerprint
// encoding/json does.
func sameFingerprint(t testing.TB, data []byte) {
	t.Helper()
	got, err := dataFingerprint(pubsubEvent("ce", data))
	if err != nil {
		t.Fatalf("data %q: %v", data, err)
	}
	if want := decodedDataFingerprint(data); got != want {
		t.Fatalf("data %q: fingerprint %q, encoding/json gives %q", data, got, want)
	}
}

func TestDataFingerprintScanGivesTheDecodedFingerprint(t *testing.T) {
	for _, c := range fingerprintCases {
		sameFingerprint(t, []byte(c))
	}
	// And the fingerprint is the SHA-256 of the decoded data.
	fp, _ := dataFingerprint(pubsubEvent("ce", []byte(`{"message":{"data":"`+base64.StdEncoding.EncodeToString([]byte("hello"))+`"}}`)))
	sum := sha256.Sum256([]byte("hello"))
	if want := fingerprintString(DataFingerprintScheme, sum[:]); fp != want || len(fp) != len("data-sha256:")+32 {
		t.Fatalf("fingerprint %q, want %q", fp, want)
	}
}

// FuzzDataFingerprintScan compares the default fingerprint's fast path
// with encoding/json on arbitrary data.
func FuzzDataFingerprintScan(f *testing.F) {
	for _, c := range fingerprintCases {
		f.Add([]byte(c))
	}
	for _, c := range scanCases {
		f.Add([]byte(c.data))
	}
	f.Fuzz(func(t *testing.T, data []byte) { sameFingerprint(t, data) })
}
