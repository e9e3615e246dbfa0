package pushauth_test

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/pushauth"
	"github.com/gcp-pubsub-idempotency/idempotency/pushauth/pushauthtest"
)

// A Cloud Tasks HTTP task created with --oidc-service-account-email
// carries a Google-signed ID token of that account, whose audience is the
// task's URL (or --oidc-token-audience): the Verifier of that audience
// and account, given to TaskHandler through WithPushAuth, accepts it and
// refuses a missing token (401) and another account's (403) before
// anything is claimed.
func TestTaskHandlerWithVerify(t *testing.T) {
	const url, tasksSA = "https://invoices.example.com/tasks/send-invoice", "tasks@my-project.iam.gserviceaccount.com"
	iss := pushauthtest.NewIssuer()
	defer iss.Close()
	v, err := pushauth.New(t.Context(), url, tasksSA, pushauth.WithHTTPClient(iss.Client()))
	if err != nil {
		t.Fatal(err)
	}
	s := fake.New()
	var runs atomic.Int32
	h := idempotency.TaskHandler(s, http.HandlerFunc(func(http.ResponseWriter, *http.Request) { runs.Add(1) }),
		idempotency.WithPushAuth(v.Verify), idempotency.WithLogger(slog.New(slog.DiscardHandler)))
	for _, tc := range []struct {
		name, token string
		want        int
	}{
		{"no token", "", http.StatusUnauthorized},
		{"another account's token", iss.Token(url, "intruder@example.com"), http.StatusForbidden},
		{"another audience's token", iss.Token("https://other.example.com/", tasksSA), http.StatusUnauthorized},
		{"the task's token", iss.Token(url, tasksSA), http.StatusOK},
	} {
		r := httptest.NewRequest(http.MethodPost, "/tasks/send-invoice", strings.NewReader("INV-1001"))
		r.Header.Set("X-CloudTasks-QueueName", "invoices")
		r.Header.Set("X-CloudTasks-TaskName", "send-INV-1001")
		if tc.token != "" {
			r.Header.Set("Authorization", "Bearer "+tc.token)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != tc.want {
			t.Fatalf("%s: %d, want %d", tc.name, w.Code, tc.want)
		}
	}
	if runs.Load() != 1 || s.Len() != 1 {
		t.Fatalf("runs %d, records %d; want the authenticated task's alone", runs.Load(), s.Len())
	}
}
