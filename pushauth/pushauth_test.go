package pushauth_test

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"math/big"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/pushauth"
)

const (
	audience = "https://orders.example.com/orders"
	pushSA   = "push@my-project.iam.gserviceaccount.com"
	keyID    = "test-key-1"
	// iapKeyID is the kid of the ES256 key in the stand-in for Google's
	// IAP key set, which idtoken reads for an ES256 token.
	iapKeyID = "iap-key-1"
)

// google is a stand-in for Google's certificate endpoints: an httptest
// server publishing one RSA key as a JWKS, and one P-256 key as IAP's
// JWKS, reached through a client whose transport sends every request to
// it (idtoken fetches https://www.googleapis.com/oauth2/v3/certs for an
// RS256 token, https://www.gstatic.com/iap/verify/public_key-jwk for an
// ES256 one). Nothing reaches the network.
type google struct {
	key     *rsa.PrivateKey
	fetches atomic.Int32
	client  *http.Client
}

func newGoogle(t testing.TB) *google {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	ec, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	g := &google{key: key}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b64 := base64.RawURLEncoding.EncodeToString
		w.Header().Set("Cache-Control", "public, max-age=3600")
		switch r.URL.Path {
		case "/oauth2/v3/certs":
			g.fetches.Add(1)
			json.NewEncoder(w).Encode(map[string]any{"keys": []map[string]string{{
				"kid": keyID, "kty": "RSA", "alg": "RS256", "use": "sig",
				"n": b64(key.N.Bytes()), "e": b64(big.NewInt(int64(key.E)).Bytes()),
			}}})
		case "/iap/verify/public_key-jwk":
			json.NewEncoder(w).Encode(map[string]any{"keys": []map[string]string{{
				"kid": iapKeyID, "kty": "EC", "alg": "ES256", "use": "sig", "crv": "P-256",
				"x": b64(ec.X.FillBytes(make([]byte, 32))), "y": b64(ec.Y.FillBytes(make([]byte, 32))),
			}}})
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	to, _ := url.Parse(srv.URL)
	g.client = &http.Client{Transport: rewrite{to: to}}
	return g
}

// rewrite sends every request to the host of to.
type rewrite struct{ to *url.URL }

func (rw rewrite) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.URL.Scheme, r.URL.Host = rw.to.Scheme, rw.to.Host
	return http.DefaultTransport.RoundTrip(r)
}

// token returns an RS256 JWT with the claims, signed by key under kid.
func token(t testing.TB, key *rsa.PrivateKey, kid string, claims map[string]any) string {
	t.Helper()
	b64 := base64.RawURLEncoding.EncodeToString
	head, _ := json.Marshal(map[string]string{"alg": "RS256", "typ": "JWT", "kid": kid})
	body, _ := json.Marshal(claims)
	signed := b64(head) + "." + b64(body)
	sum := sha256.Sum256([]byte(signed))
	sig, err := rsa.SignPKCS1v15(rand.Reader, key, crypto.SHA256, sum[:])
	if err != nil {
		t.Fatal(err)
	}
	return signed + "." + b64(sig)
}

// claims are those of a push subscription's token, with changes.
func claims(change map[string]any) map[string]any {
	c := map[string]any{
		"iss": "https://accounts.google.com", "aud": audience, "sub": "1234567890",
		"email": pushSA, "email_verified": true,
		"iat": time.Now().Add(-time.Minute).Unix(), "exp": time.Now().Add(time.Hour).Unix(),
	}
	for k, v := range change {
		if v == nil {
			delete(c, k)
			continue
		}
		c[k] = v
	}
	return c
}

func request(auth ...string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"message":{"messageId":"m-1"}}`))
	for _, a := range auth {
		r.Header.Add("Authorization", a)
	}
	return r
}

func TestVerifyAcceptsOnlyThePushSubscriptionsToken(t *testing.T) {
	g := newGoogle(t)
	v, err := pushauth.New(t.Context(), audience, pushSA, pushauth.WithHTTPClient(g.client))
	if err != nil {
		t.Fatal(err)
	}
	other, _ := rsa.GenerateKey(rand.Reader, 2048)
	good := token(t, g.key, keyID, claims(nil))
	parts := strings.Split(good, ".")
	type want int
	const (
		ok want = iota
		unauthenticated
		forbidden
	)
	cases := []struct {
		name string
		auth []string
		want want
	}{
		{"the push subscription's token", []string{"Bearer " + good}, ok},
		{"scheme in lower case", []string{"bearer " + good}, ok},
		{"service account in another case", []string{"Bearer " + token(t, g.key, keyID, claims(map[string]any{"email": strings.ToUpper(pushSA)}))}, ok},
		{"issuer without scheme", []string{"Bearer " + token(t, g.key, keyID, claims(map[string]any{"iss": "accounts.google.com"}))}, ok},
		{"no Authorization header", nil, unauthenticated},
		{"two Authorization headers", []string{"Bearer " + good, "Bearer " + good}, unauthenticated},
		{"not a bearer token", []string{"Basic dXNlcjpwYXNz"}, unauthenticated},
		{"empty bearer token", []string{"Bearer "}, unauthenticated},
		{"not a JWT", []string{"Bearer abc"}, unauthenticated},
		{"another audience", []string{"Bearer " + token(t, g.key, keyID, claims(map[string]any{"aud": "https://elsewhere.example.com"}))}, unauthenticated},
		{"expired", []string{"Bearer " + token(t, g.key, keyID, claims(map[string]any{"exp": time.Now().Add(-time.Minute).Unix()}))}, unauthenticated},
		{"signed by another key under Google's kid", []string{"Bearer " + token(t, other, keyID, claims(nil))}, unauthenticated},
		{"unknown kid", []string{"Bearer " + token(t, g.key, "no-such-key", claims(nil))}, unauthenticated},
		{"claims changed after signing", []string{"Bearer " + parts[0] + "." + base64.RawURLEncoding.EncodeToString([]byte(`{"aud":"`+audience+`","email":"attacker@example.com","email_verified":true,"iss":"https://accounts.google.com","exp":9999999999}`)) + "." + parts[2]}, unauthenticated},
		{"alg none", []string{"Bearer " + base64.RawURLEncoding.EncodeToString([]byte(`{"alg":"none"}`)) + "." + parts[1] + "."}, unauthenticated},
		{"signature removed by Cloud Run", []string{"Bearer " + parts[0] + "." + parts[1] + ".SIGNATURE_REMOVED_BY_GOOGLE"}, unauthenticated},
		{"another issuer", []string{"Bearer " + token(t, g.key, keyID, claims(map[string]any{"iss": "https://evil.example.com"}))}, unauthenticated},
		{"another service account", []string{"Bearer " + token(t, g.key, keyID, claims(map[string]any{"email": "other@my-project.iam.gserviceaccount.com"}))}, forbidden},
		{"email not verified", []string{"Bearer " + token(t, g.key, keyID, claims(map[string]any{"email_verified": false}))}, forbidden},
		{"email_verified as a string", []string{"Bearer " + token(t, g.key, keyID, claims(map[string]any{"email_verified": "true"}))}, forbidden},
		{"no email", []string{"Bearer " + token(t, g.key, keyID, claims(map[string]any{"email": nil}))}, forbidden},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := v.Verify(request(c.auth...))
			switch c.want {
			case ok:
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
			case unauthenticated:
				if !errors.Is(err, pushauth.ErrUnauthenticated) || errors.Is(err, idempotency.ErrPushForbidden) {
					t.Fatalf("error %v, want ErrUnauthenticated only", err)
				}
			case forbidden:
				if !errors.Is(err, idempotency.ErrPushForbidden) || errors.Is(err, pushauth.ErrUnauthenticated) {
					t.Fatalf("error %v, want ErrPushForbidden only", err)
				}
			}
			if err != nil && len(c.auth) == 1 && strings.Count(c.auth[0], ".") == 2 && strings.Contains(err.Error(), strings.TrimPrefix(strings.TrimPrefix(c.auth[0], "Bearer "), "bearer ")) {
				t.Fatalf("the error %q contains the token", err)
			}
			if c.name == "signature removed by Cloud Run" && !strings.Contains(err.Error(), "Cloud Run") {
				t.Fatalf("the error %q does not say Cloud Run removed the signature", err)
			}
		})
	}
	if n := g.fetches.Load(); n != 1 {
		t.Fatalf("the keys were fetched %d times, want once (cached)", n)
	}
}

func TestNewRefusesWhatCannotCheck(t *testing.T) {
	for _, c := range []struct{ aud, sa string }{{"", pushSA}, {audience, ""}, {audience, "not-an-email"}} {
		if _, err := pushauth.New(t.Context(), c.aud, c.sa); err == nil {
			t.Errorf("New(%q, %q) accepted", c.aud, c.sa)
		}
	}
	if _, err := pushauth.New(t.Context(), audience, pushSA, pushauth.WithHTTPClient(nil)); err == nil {
		t.Error("a nil client accepted")
	}
}

// Through PushHandler on a real server: the push subscription's token is
// guarded and deduplicated; a forged or foreign token is refused with
// 401/403 and never claims its (business) key, so the real message that
// follows still runs.
func TestPushHandlerWithVerify(t *testing.T) {
	g := newGoogle(t)
	v, err := pushauth.New(t.Context(), audience, pushSA, pushauth.WithHTTPClient(g.client))
	if err != nil {
		t.Fatal(err)
	}
	s := fake.New()
	var runs []string
	h := func(_ context.Context, e cloudevents.Event) error {
		ev, _ := idempotency.ParsePubSub(e)
		runs = append(runs, string(ev.Message.Data))
		return nil
	}
	srv := httptest.NewServer(idempotency.PushHandler(s, h, idempotency.WithLogger(slog.New(slog.DiscardHandler)),
		idempotency.WithKey(idempotency.Attribute("po_id")), idempotency.WithPushAuth(v.Verify)))
	defer srv.Close()
	post := func(id, data, auth string) int {
		body := fmt.Sprintf(`{"message":{"messageId":%q,"data":%q,"attributes":{"po_id":"PO-1"}}}`, id, base64.StdEncoding.EncodeToString([]byte(data)))
		req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	other, _ := rsa.GenerateKey(rand.Reader, 2048)
	if code := post("forged-1", "qty=0", "Bearer "+token(t, other, keyID, claims(nil))); code != http.StatusUnauthorized {
		t.Fatalf("forged token: HTTP %d, want 401", code)
	}
	if code := post("forged-2", "qty=0", ""); code != http.StatusUnauthorized {
		t.Fatalf("no token: HTTP %d, want 401", code)
	}
	foreign := token(t, g.key, keyID, claims(map[string]any{"email": "someone@my-project.iam.gserviceaccount.com"}))
	if code := post("forged-3", "qty=0", "Bearer "+foreign); code != http.StatusForbidden {
		t.Fatalf("another account's token: HTTP %d, want 403", code)
	}
	if s.Len() != 0 || len(runs) != 0 {
		t.Fatalf("refused requests left %d records and %d runs", s.Len(), len(runs))
	}
	good := "Bearer " + token(t, g.key, keyID, claims(nil))
	for range 2 {
		if code := post("m-1", "qty=1", good); code != http.StatusNoContent {
			t.Fatalf("the push subscription's token: HTTP %d, want 204", code)
		}
	}
	if len(runs) != 1 || runs[0] != "qty=1" {
		t.Fatalf("runs %q, want the real message once", runs)
	}
}

// BenchmarkVerify: one Verify of a valid token, the signing keys cached
// (what WithPushAuth(v.Verify) adds to each delivery).
func BenchmarkVerify(b *testing.B) {
	g := newGoogle(b)
	v, err := pushauth.New(b.Context(), audience, pushSA, pushauth.WithHTTPClient(g.client))
	if err != nil {
		b.Fatal(err)
	}
	auth := "Bearer " + token(b, g.key, keyID, claims(nil))
	for b.Loop() {
		if err := v.Verify(request(auth)); err != nil {
			b.Fatal(err)
		}
	}
}

// forged is a token an unauthenticated sender can write: any header and
// claims, and a signature of its choosing.
func forged(header, claims string, sig []byte) string {
	b64 := base64.RawURLEncoding.EncodeToString
	return b64([]byte(header)) + "." + b64([]byte(claims)) + "." + b64(sig)
}

// verify calls Verify and reports a panic as an error of the test.
func verify(t testing.TB, v *pushauth.Verifier, r *http.Request) (err error) {
	t.Helper()
	defer func() {
		if p := recover(); p != nil {
			t.Fatalf("Verify panicked: %v", p)
		}
	}()
	return v.Verify(r)
}

// passingClaims are claims that pass idtoken's audience and expiry
// checks, which a forger writes too.
var passingClaims = fmt.Sprintf(`{"iss":"https://accounts.google.com","aud":%q,"email":%q,"email_verified":true,"exp":4102444800}`, audience, pushSA)

// A forged ES256 token whose kid is in Google's (IAP) key set and whose
// signature is shorter than 32 bytes made idtoken slice past its end and
// panic (issue 23): through PushHandler, the client saw EOF and the log a
// stack trace. Verify refuses every alg but RS256 before idtoken sees the
// token, so the request is a 401.
func TestForgedES256WithShortSignatureIsRefusedNotAPanic(t *testing.T) {
	g := newGoogle(t)
	v, err := pushauth.New(t.Context(), audience, pushSA, pushauth.WithHTTPClient(g.client))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, header string
		sig          []byte
	}{
		{"ES256, IAP kid, 5-byte signature", `{"alg":"ES256","typ":"JWT","kid":"` + iapKeyID + `"}`, []byte("short")},
		{"ES256, IAP kid, empty signature", `{"alg":"ES256","typ":"JWT","kid":"` + iapKeyID + `"}`, nil},
		{"ES256, IAP kid, 64-byte signature", `{"alg":"ES256","typ":"JWT","kid":"` + iapKeyID + `"}`, make([]byte, 64)},
		{"alg in another case after RS256", `{"alg":"RS256","ALG":"ES256","kid":"` + iapKeyID + `"}`, []byte("short")},
		{"HS256", `{"alg":"HS256","kid":"` + keyID + `"}`, []byte("short")},
		{"no alg", `{"kid":"` + keyID + `"}`, []byte("short")},
		{"header not JSON", `ES256`, []byte("short")},
	} {
		t.Run(c.name, func(t *testing.T) {
			tok := forged(c.header, passingClaims, c.sig)
			err := verify(t, v, request("Bearer "+tok))
			if !errors.Is(err, pushauth.ErrUnauthenticated) || errors.Is(err, idempotency.ErrPushForbidden) {
				t.Fatalf("error %v, want ErrUnauthenticated only", err)
			}
			if strings.Contains(err.Error(), tok) {
				t.Fatalf("the error %q contains the token", err)
			}
		})
	}

	// Through PushHandler on a real server: a 401, not a dropped
	// connection, and no stack trace in the log.
	var logged strings.Builder
	logger := slog.New(slog.NewTextHandler(&logged, nil))
	srv := httptest.NewUnstartedServer(idempotency.PushHandler(fake.New(), func(context.Context, cloudevents.Event) error {
		t.Error("the handler ran")
		return nil
	}, idempotency.WithLogger(logger), idempotency.WithPushAuth(v.Verify)))
	srv.Config.ErrorLog = log.New(&logged, "", 0)
	srv.Start()
	defer srv.Close()
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{"message":{"messageId":"m-1"}}`))
	req.Header.Set("Authorization", "Bearer "+forged(`{"alg":"ES256","typ":"JWT","kid":"`+iapKeyID+`"}`, passingClaims, []byte("short")))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("the request failed: %v (the server dropped the connection)", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("HTTP %d, want 401", resp.StatusCode)
	}
	if strings.Contains(logged.String(), "panic") || strings.Contains(logged.String(), "goroutine ") {
		t.Fatalf("the log holds a panic:\n%s", logged.String())
	}
}

// FuzzVerifyForgedToken is an unauthenticated sender: any header, claims
// and signature (or any Authorization header at all), against a Verifier
// whose key set holds an RS256 and an ES256 key. Verify never panics, and
// refuses every such request as unauthenticated (a 401): no one without
// Google's private key gets a token through, nor a 403 that says the
// token was Google's.
func FuzzVerifyForgedToken(f *testing.F) {
	g := newGoogle(f)
	v, err := pushauth.New(f.Context(), audience, pushSA, pushauth.WithHTTPClient(g.client))
	if err != nil {
		f.Fatal(err)
	}
	es256 := `{"alg":"ES256","typ":"JWT","kid":"` + iapKeyID + `"}`
	rs256 := `{"alg":"RS256","typ":"JWT","kid":"` + keyID + `"}`
	f.Add(es256, passingClaims, []byte("short"), "")
	f.Add(es256, passingClaims, []byte{}, "")
	f.Add(es256, passingClaims, make([]byte, 64), "")
	f.Add(rs256, passingClaims, make([]byte, 256), "")
	f.Add(rs256, passingClaims, []byte("short"), "")
	f.Add(`{"alg":"none"}`, passingClaims, []byte{}, "")
	f.Add(`{"alg":"RS256","ALG":"ES256","kid":"`+iapKeyID+`"}`, passingClaims, []byte("x"), "")
	f.Add(rs256, `{"aud":"`+audience+`","exp":1e400}`, []byte("x"), "")
	f.Add("", "", []byte{}, "Bearer a.b.c")
	f.Add("", "", []byte{}, "Bearer ..SIGNATURE_REMOVED_BY_GOOGLE")
	f.Fuzz(func(t *testing.T, header, claims string, sig []byte, raw string) {
		auth := raw
		if auth == "" {
			auth = "Bearer " + forged(header, claims, sig)
		}
		err := verify(t, v, request(auth))
		if !errors.Is(err, pushauth.ErrUnauthenticated) || errors.Is(err, idempotency.ErrPushForbidden) {
			t.Fatalf("Authorization %q: error %v, want ErrUnauthenticated only", auth, err)
		}
		if tok := strings.TrimSpace(auth[min(len(auth), len("Bearer ")):]); len(tok) >= 16 && strings.Contains(err.Error(), tok) {
			t.Fatalf("the error %q contains the token", err)
		}
	})
}

// panicking is a transport that panics, as a bug on the token check's
// path would.
type panicking struct{}

func (panicking) RoundTrip(*http.Request) (*http.Response, error) { panic("transport bug") }

// Whatever panics while a token is checked (here the fetch of Google's
// keys), Verify refuses the request as unauthenticated instead of
// panicking, and the error carries neither the token nor the panic.
func TestPanicInTheTokenCheckIsARefusal(t *testing.T) {
	g := newGoogle(t)
	v, err := pushauth.New(t.Context(), audience, pushSA, pushauth.WithHTTPClient(&http.Client{Transport: panicking{}}))
	if err != nil {
		t.Fatal(err)
	}
	tok := token(t, g.key, keyID, claims(nil))
	err = verify(t, v, request("Bearer "+tok))
	if !errors.Is(err, pushauth.ErrUnauthenticated) {
		t.Fatalf("error %v, want ErrUnauthenticated", err)
	}
	if strings.Contains(err.Error(), tok) || strings.Contains(err.Error(), "transport bug") {
		t.Fatalf("the error %q carries the token or the panic", err)
	}
}
