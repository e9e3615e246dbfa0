package pushauthtest_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/pushauth"
	"github.com/gcp-pubsub-idempotency/idempotency/pushauth/pushauthtest"
)

// An Issuer's tokens pass a Verifier for their audience and account only,
// and its key set is fetched once for many verifications (the Verifier
// caches it as the Cache-Control header allows).
func TestIssuerTokensPassOnlyTheirVerifier(t *testing.T) {
	const aud, sa = "https://a.example.com/push", "push@p.iam.gserviceaccount.com"
	iss := pushauthtest.NewIssuer()
	defer iss.Close()
	v, err := pushauth.New(context.Background(), aud, sa, pushauth.WithHTTPClient(iss.Client()))
	if err != nil {
		t.Fatal(err)
	}
	check := func(token string) error {
		r := httptest.NewRequest(http.MethodPost, "/push", nil)
		r.Header.Set("Authorization", "Bearer "+token)
		return v.Verify(r)
	}
	for range 3 {
		if err := check(iss.Token(aud, sa)); err != nil {
			t.Fatalf("the subscription's token: %v", err)
		}
	}
	if err := check(iss.Token("https://b.example.com/push", sa)); !errors.Is(err, pushauth.ErrUnauthenticated) {
		t.Errorf("another audience's token: %v, want ErrUnauthenticated", err)
	}
	other := pushauthtest.NewIssuer()
	defer other.Close()
	if err := check(other.Token(aud, sa)); !errors.Is(err, pushauth.ErrUnauthenticated) {
		t.Errorf("another issuer's key: %v, want ErrUnauthenticated", err)
	}
	if n := iss.KeyFetches(); n != 1 {
		t.Errorf("the key set was fetched %d times, want 1", n)
	}
}
