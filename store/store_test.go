package store_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

func TestValidateKey(t *testing.T) {
	for _, k := range []string{"a", "ünï/code key", strings.Repeat("k", store.MaxKeyLen), "\xff\xfe"} {
		if err := store.ValidateKey(k); err != nil {
			t.Errorf("ValidateKey(%.20q) = %v, want nil", k, err)
		}
	}
	for k, why := range map[string]string{
		"":                                     "empty",
		"a\x00b":                               "NUL",
		strings.Repeat("k", store.MaxKeyLen+1): "1025 bytes",
	} {
		err := store.ValidateKey(k)
		if !errors.Is(err, store.ErrInvalidKey) || !strings.Contains(err.Error(), why) {
			t.Errorf("ValidateKey(%.20q) = %v, want ErrInvalidKey saying %q", k, err, why)
		}
	}
}

func TestValidateDurations(t *testing.T) {
	if err := store.ValidateLease(time.Nanosecond); err != nil {
		t.Error(err)
	}
	if err := store.ValidateLease(0); !errors.Is(err, store.ErrInvalidLease) {
		t.Errorf("lease 0: %v", err)
	}
	if err := store.ValidateTTL(-time.Second); !errors.Is(err, store.ErrInvalidTTL) || !strings.Contains(err.Error(), "-1s") {
		t.Errorf("ttl -1s: %v", err)
	}
}

func TestNames(t *testing.T) {
	got := []string{
		store.Claimed.String(), store.Done.String(), store.State(9).String(),
		store.Won.String(), store.AlreadyDone.String(), store.HeldByOther.String(), store.Outcome(0).String(),
	}
	want := "claimed done state(9) won already done held by other outcome(0)"
	if strings.Join(got, " ") != want {
		t.Fatalf("got %q", strings.Join(got, " "))
	}
}

// The defaults satisfy the sizing rule: lease + ttl outlives Cloud Run's
// 60-minute request cap.
func TestDefaultsOutliveACloudRunRequest(t *testing.T) {
	if store.DefaultLease+store.DefaultTTL <= 60*time.Minute {
		t.Fatalf("lease %v + ttl %v does not exceed 60m", store.DefaultLease, store.DefaultTTL)
	}
}

func TestNewTokenIsRandomHex(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		tok := store.NewToken()
		if len(tok) != 24 || strings.Trim(tok, "0123456789abcdef") != "" || seen[tok] {
			t.Fatalf("token %q: want 24 fresh hex digits", tok)
		}
		seen[tok] = true
	}
}
