// Package pushauth verifies that a Pub/Sub push request comes from the push
// subscription it should come from, for [idempotency.WithPushAuth]:
//
//	v, err := pushauth.New(ctx, "https://orders.example.com/orders", "push@my-project.iam.gserviceaccount.com")
//	...
//	http.Handle("/orders", idempotency.PushHandler(backend, handleOrder, idempotency.WithPushAuth(v.Verify)))
//
// A push subscription created with --push-auth-service-account puts a
// Google-signed OIDC token of that service account on every request
// (Authorization: Bearer), whose audience is the subscription's
// --push-auth-token-audience, or its push endpoint URL when that is unset.
// [Verifier.Verify] accepts a request only when that token's signature
// (against Google's published keys, with [idtoken]), expiry, audience and
// issuer are valid and its email claim is the service account's, verified.
//
// Why it matters: a push endpoint that anyone can reach can be sent a
// forged message with a business key of the attacker's choosing, which the
// guard then records as done, so that the real message is acked as a
// duplicate and never processed. On Cloud Run and Cloud Run functions,
// deploy with authentication required instead (Cloud Run checks the token
// and the caller's run.invoker role before the request reaches the
// container, and removes the token's signature, so this package cannot
// check it again there); use this package where the endpoint must accept
// unauthenticated traffic or runs elsewhere.
//
// To test a handler behind a Verifier, the pushauthtest package mints
// push tokens and publishes their key to a Verifier made with its client.
//
// This is a module of its own because google.golang.org/api is large: the
// root module does not depend on it.
package pushauth

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"google.golang.org/api/idtoken"
	"google.golang.org/api/option"

	"github.com/gcp-pubsub-idempotency/idempotency"
)

// ErrUnauthenticated is wrapped by every error of [Verifier.Verify] for a
// request without a valid Google-signed token for the audience:
// [idempotency.PushHandler] answers it 401.
var ErrUnauthenticated = errors.New("pushauth: no valid push token")

// Issuers are the issuers of Google-signed OIDC tokens.
var issuers = map[string]bool{"https://accounts.google.com": true, "accounts.google.com": true}

// removedSignature is what Cloud Run puts in place of the signature of a
// token it verified itself before passing the request on.
const removedSignature = "SIGNATURE_REMOVED_BY_GOOGLE"

// Verifier checks push requests' OIDC tokens. It is safe for concurrent
// use; it caches Google's signing keys as long as their response allows.
type Verifier struct {
	audience string
	email    string
	v        *idtoken.Validator
}

// Option configures [New].
type Option func(*options)

type options struct {
	client *http.Client
}

// WithHTTPClient sets the client that fetches Google's signing keys (from
// https://www.googleapis.com/oauth2/v3/certs). The default is
// [http.DefaultClient]. A client for tests, or through a proxy.
func WithHTTPClient(c *http.Client) Option {
	return func(o *options) { o.client = c }
}

// New returns a Verifier of tokens whose audience is audience (the
// subscription's --push-auth-token-audience, or its push endpoint URL when
// that is unset) and whose email is serviceAccount (the subscription's
// --push-auth-service-account). Both are required: an empty audience would
// make [idtoken] skip the audience check, and then a token minted for any
// other service would do.
func New(ctx context.Context, audience, serviceAccount string, opts ...Option) (*Verifier, error) {
	if audience == "" {
		return nil, fmt.Errorf("pushauth: empty audience")
	}
	if serviceAccount == "" || !strings.Contains(serviceAccount, "@") {
		return nil, fmt.Errorf("pushauth: %q is not a service account email", serviceAccount)
	}
	o := options{client: http.DefaultClient}
	for _, opt := range opts {
		opt(&o)
	}
	if o.client == nil {
		return nil, fmt.Errorf("pushauth: nil HTTP client")
	}
	v, err := idtoken.NewValidator(ctx, option.WithHTTPClient(o.client))
	if err != nil {
		return nil, fmt.Errorf("pushauth: %w", err)
	}
	return &Verifier{audience: audience, email: strings.ToLower(serviceAccount), v: v}, nil
}

// Verify checks r's bearer token, for [idempotency.WithPushAuth]. It
// returns nil for a token Google signed, unexpired, for the Verifier's
// audience, from Google's issuer, whose email claim is the Verifier's
// service account and verified. It returns an error wrapping
// [ErrUnauthenticated] when r has no single bearer token or the token is
// not valid for the audience (including a token whose signature Cloud Run
// removed: see the package doc), and an error wrapping
// [idempotency.ErrPushForbidden] for a valid token of another account.
// Errors never contain the token.
//
// Pub/Sub signs its tokens with RS256: a token with any other alg in its
// header (ES256, which idtoken would check against IAP's keys, HS256,
// none) is refused before its signature is looked at. Verify never
// panics: should the token check panic, the request is refused as
// unauthenticated, so that a forged token cannot turn into a dropped
// connection and a stack trace in the log.
func (v *Verifier) Verify(r *http.Request) error {
	auths := r.Header.Values("Authorization")
	if len(auths) != 1 {
		return fmt.Errorf("%w: want one Authorization header, found %d", ErrUnauthenticated, len(auths))
	}
	scheme, token, ok := strings.Cut(auths[0], " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") || strings.TrimSpace(token) == "" {
		return fmt.Errorf("%w: the Authorization header is not a bearer token", ErrUnauthenticated)
	}
	token = strings.TrimSpace(token)
	if strings.HasSuffix(token, "."+removedSignature) {
		return fmt.Errorf("%w: the token's signature was removed by Cloud Run, which verified it itself: with authentication required, Cloud Run is the check, and WithPushAuth cannot repeat it", ErrUnauthenticated)
	}
	if alg, err := algorithm(token); err != nil {
		return fmt.Errorf("%w: %v", ErrUnauthenticated, err)
	} else if alg != "RS256" {
		return fmt.Errorf("%w: the token is signed with %.32q, and Pub/Sub signs with RS256", ErrUnauthenticated, alg)
	}
	p, err := v.validate(r.Context(), token)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrUnauthenticated, err)
	}
	return v.claims(p)
}

// validate is idtoken's check of the token, with a panic in it turned
// into an error that says nothing of the token or of the panic's value.
func (v *Verifier) validate(ctx context.Context, token string) (p *idtoken.Payload, err error) {
	defer func() {
		if recover() != nil {
			p, err = nil, errors.New("the token check failed on a malformed token")
		}
	}()
	return v.v.Validate(ctx, token, v.audience)
}

// algorithm returns the alg of the token's header, read as idtoken reads
// it (base64url without padding, then encoding/json into a struct field
// tagged "alg": a repeated or differently cased "alg" key is resolved the
// same way in both places), so that the alg checked here is the one
// idtoken would act on.
func algorithm(token string) (string, error) {
	head, _, ok := strings.Cut(token, ".")
	if !ok {
		return "", errors.New("the token is not a JWT")
	}
	raw, err := base64.RawURLEncoding.DecodeString(head)
	if err != nil {
		return "", errors.New("the token's header is not base64url")
	}
	var h struct {
		Algorithm string `json:"alg"`
	}
	if err := json.Unmarshal(raw, &h); err != nil {
		return "", errors.New("the token's header is not a JSON object")
	}
	return h.Algorithm, nil
}

// claims checks what idtoken.Validate leaves to its caller: the issuer
// and the account.
func (v *Verifier) claims(p *idtoken.Payload) error {
	if !issuers[p.Issuer] {
		return fmt.Errorf("%w: issuer %q is not Google's", ErrUnauthenticated, p.Issuer)
	}
	email, _ := p.Claims["email"].(string)
	if verified, _ := p.Claims["email_verified"].(bool); !verified {
		return fmt.Errorf("%w: the token's email %q is not verified", idempotency.ErrPushForbidden, email)
	}
	if strings.ToLower(email) != v.email {
		return fmt.Errorf("%w: the token is %q's, not the push subscription's %q", idempotency.ErrPushForbidden, email, v.email)
	}
	return nil
}
