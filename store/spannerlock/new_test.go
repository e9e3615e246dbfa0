package spannerlock_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"cloud.google.com/go/spanner"
	"google.golang.org/api/option"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
)

// New refuses a nil client, an invalid option, and WithClientOptions (it
// does not dial).
func TestNewRefusesBadConfiguration(t *testing.T) {
	c := &spanner.Client{} // never used: New sends nothing
	for name, tc := range map[string]struct {
		client *spanner.Client
		opts   []spannerlock.Option
		want   error
	}{
		"nil client":       {},
		"ttl -1":           {client: c, opts: []spannerlock.Option{spannerlock.WithTTL(-1)}, want: store.ErrInvalidTTL},
		"bad table":        {client: c, opts: []spannerlock.Option{spannerlock.WithTable("a-b")}},
		"empty table":      {client: c, opts: []spannerlock.Option{spannerlock.WithTable("")}},
		"negative retries": {client: c, opts: []spannerlock.Option{spannerlock.WithRetries(-1)}},
		"client options":   {client: c, opts: []spannerlock.Option{spannerlock.WithClientOptions(option.WithoutAuthentication())}},
	} {
		b, err := spannerlock.New(tc.client, tc.opts...)
		switch {
		case err == nil:
			t.Errorf("%s: New accepted it: %v", name, b)
		case tc.want != nil && !errors.Is(err, tc.want):
			t.Errorf("%s: %v, want an error wrapping %v", name, err, tc.want)
		}
	}
	b, err := spannerlock.New(c, spannerlock.WithRetries(0), spannerlock.WithTTL(time.Minute), spannerlock.WithTable("Keys_2"))
	if err != nil || b.TTL() != time.Minute || !strings.HasPrefix(b.Schema(), "CREATE TABLE Keys_2 (") {
		t.Fatalf("a valid configuration: %v", err)
	}
}

// Dial honours SPANNER_EMULATOR_HOST; EnsureSchema creates the table
// once (a second call finds it), with its row deletion policy; the
// Backend works, and its Close closes the client it opened.
func TestDialAndEnsureSchema(t *testing.T) {
	testsvc.Spanner(t)
	db := testsvc.SpannerDatabase(t)
	ctx := t.Context()
	b, err := spannerlock.Dial(ctx, db, spannerlock.WithTable("Keys"))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	for range 2 {
		if err := b.EnsureSchema(ctx, nil); err != nil {
			t.Fatal(err)
		}
	}
	r, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim: %+v %v", r, err)
	}
	if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
		t.Fatalf("complete: %v %v", ok, err)
	}
	if _, err := spannerlock.Dial(ctx, ""); err == nil {
		t.Fatal("Dial accepted an empty database name")
	}
}
