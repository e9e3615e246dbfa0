package pushauthtest_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/pushauth"
	"github.com/gcp-pubsub-idempotency/idempotency/pushauth/pushauthtest"
)

// A push handler behind pushauth, tested with tokens from an Issuer: the
// push subscription's token is accepted, a missing one is refused (401),
// another account's (403), and an expired one (401).
func ExampleIssuer() {
	const audience, pushSA = "https://orders.example.com/orders", "push@my-project.iam.gserviceaccount.com"
	iss := pushauthtest.NewIssuer()
	defer iss.Close()
	v, err := pushauth.New(context.Background(), audience, pushSA, pushauth.WithHTTPClient(iss.Client()))
	if err != nil {
		panic(err)
	}
	h := idempotency.PushHandler(fake.New(), func(context.Context, cloudevents.Event) error { return nil },
		idempotency.WithPushAuth(v.Verify), idempotency.WithLogger(slog.New(slog.DiscardHandler)))

	expired := pushauthtest.PushClaims(audience, pushSA)
	expired["exp"] = time.Now().Add(-time.Hour).Unix()
	for _, tc := range []struct{ name, token string }{
		{"the subscription's token", iss.Token(audience, pushSA)},
		{"no token", ""},
		{"another account's token", iss.Token(audience, "intruder@example.com")},
		{"an expired token", iss.Sign(expired)},
	} {
		r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"message":{"messageId":"m-1","data":""},"subscription":"projects/p/subscriptions/s"}`))
		if tc.token != "" {
			r.Header.Set("Authorization", "Bearer "+tc.token)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		fmt.Println(tc.name+":", w.Code)
	}
	// Output:
	// the subscription's token: 204
	// no token: 401
	// another account's token: 403
	// an expired token: 401
}
