// Package pushauthtest mints the OIDC tokens a Pub/Sub push subscription
// sends, for tests of a handler behind [pushauth.Verifier]: an [Issuer]
// signs tokens with a key of its own and publishes that key where
// [pushauth.New], given the Issuer's client, looks for Google's keys.
// Nothing reaches the network.
//
//	iss := pushauthtest.NewIssuer()
//	defer iss.Close()
//	v, err := pushauth.New(ctx, audience, serviceAccount, pushauth.WithHTTPClient(iss.Client()))
//	...
//	req.Header.Set("Authorization", "Bearer "+iss.Token(audience, serviceAccount))
package pushauthtest

import (
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync/atomic"
	"time"
)

// KeyID is the kid of an Issuer's signing key, in its tokens' headers and
// in the key set it publishes.
const KeyID = "pushauthtest-key-1"

// GoogleIssuer is the iss claim of the tokens an Issuer mints, Google's.
const GoogleIssuer = "https://accounts.google.com"

// Issuer stands in for Google's OIDC token issuer: it signs RS256 tokens
// with a 2048-bit RSA key made for it, and serves that key, as a JSON Web
// Key Set, to the requests of its [Issuer.Client]. It is safe for
// concurrent use.
type Issuer struct {
	key     *rsa.PrivateKey
	srv     *httptest.Server
	client  *http.Client
	fetches atomic.Int64
}

// NewIssuer returns an Issuer with a new key, and starts the loopback
// server that publishes it. The caller closes it. It panics if no key or
// no loopback listener can be made, as httptest.NewServer does.
func NewIssuer() *Issuer {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		panic("pushauthtest: " + err.Error())
	}
	iss := &Issuer{key: key}
	iss.srv = httptest.NewServer(http.HandlerFunc(iss.serveKeys))
	to, _ := url.Parse(iss.srv.URL)
	iss.client = &http.Client{Transport: redirect{to: to}}
	return iss
}

// serveKeys publishes the key set at any path, with the cache lifetime
// Google's certificate endpoint gives.
func (iss *Issuer) serveKeys(w http.ResponseWriter, _ *http.Request) {
	iss.fetches.Add(1)
	b64 := base64.RawURLEncoding.EncodeToString
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "public, max-age=3600")
	json.NewEncoder(w).Encode(map[string]any{"keys": []map[string]string{{
		"kid": KeyID, "kty": "RSA", "alg": "RS256", "use": "sig",
		"n": b64(iss.key.N.Bytes()), "e": b64(big.NewInt(int64(iss.key.E)).Bytes()),
	}}})
}

// redirect sends every request to the host of to.
type redirect struct{ to *url.URL }

func (rd redirect) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.URL.Scheme, r.URL.Host = rd.to.Scheme, rd.to.Host
	return http.DefaultTransport.RoundTrip(r)
}

// Client returns the HTTP client to give [pushauth.WithHTTPClient]: every
// request it makes, whatever its URL, is answered by the Issuer's key set.
func (iss *Issuer) Client() *http.Client { return iss.client }

// KeyFetches returns how many times the key set was fetched.
func (iss *Issuer) KeyFetches() int { return int(iss.fetches.Load()) }

// Close stops the key server.
func (iss *Issuer) Close() { iss.srv.Close() }

// PushClaims returns the claims of the token a push subscription whose
// --push-auth-service-account is serviceAccount sends with audience
// audience: Google's issuer, the email, verified, issued a minute ago and
// expiring in an hour. Change or delete entries to mint a token that a
// [pushauth.Verifier] must refuse.
func PushClaims(audience, serviceAccount string) map[string]any {
	now := time.Now()
	return map[string]any{
		"iss": GoogleIssuer, "aud": audience, "sub": "100000000000000000001",
		"email": serviceAccount, "email_verified": true,
		"iat": now.Add(-time.Minute).Unix(), "exp": now.Add(time.Hour).Unix(),
	}
}

// Token returns a push token for audience and serviceAccount, with
// [PushClaims], signed by the Issuer.
func (iss *Issuer) Token(audience, serviceAccount string) string {
	return iss.Sign(PushClaims(audience, serviceAccount))
}

// Sign returns an RS256 JSON Web Token with claims, its header naming
// [KeyID], signed by the Issuer's key. It panics if claims cannot be
// encoded as JSON.
func (iss *Issuer) Sign(claims map[string]any) string {
	b64 := base64.RawURLEncoding.EncodeToString
	head, _ := json.Marshal(map[string]string{"alg": "RS256", "typ": "JWT", "kid": KeyID})
	body, err := json.Marshal(claims)
	if err != nil {
		panic(fmt.Sprintf("pushauthtest: claims: %v", err))
	}
	signed := b64(head) + "." + b64(body)
	sum := sha256.Sum256([]byte(signed))
	sig, err := rsa.SignPKCS1v15(rand.Reader, iss.key, crypto.SHA256, sum[:])
	if err != nil {
		panic("pushauthtest: " + err.Error())
	}
	return signed + "." + b64(sig)
}
