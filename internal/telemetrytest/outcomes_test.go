package telemetrytest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"
	"github.com/google/go-cmp/cmp"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/pubsubtest"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var epoch = time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)

const key = "orders:PO-1"

// Every outcome of Lock and Mutex: the spans (in the order they start;
// "!" marks an Error status), the outcome on the call's span, and what
// the three instruments counted. In every one, no span carries the key
// anywhere (keyFree), though the backend's errors name it, as the real
// backends' do, and a body's error may too: on main, claim_failed and
// payload_mismatch put it in the call span's status and exception event.
func TestEveryOutcomeIsTracedAndCounted(t *testing.T) {
	errBody := errors.New("supplier said no")
	errStore := errors.New("store unreachable")
	claimErr := func(key string) error { return fmt.Errorf("store: claim %q: %w", key, errStore) }
	settleErr := func(op string, c store.Claim) error {
		return fmt.Errorf("store: %s %q fence %d: %w", op, c.Key, c.Fence, errStore)
	}
	type setup struct {
		b     store.Backend
		fn    func(context.Context) error
		mutex bool
		opts  []idempotency.LockOption
	}
	cases := []struct {
		name        string
		setup       func(t *testing.T) setup
		wantSpans   []string
		wantOutcome string
		wantClaim   string // the claim histogram's attributes
		wantSettle  string // the settle histogram's attributes; empty: none
	}{
		{
			name: "won",
			setup: func(t *testing.T) setup {
				return setup{b: fake.New(), fn: ok}
			},
			wantSpans:   []string{"idempotency.lock", "idempotency.claim", "idempotency.body", "idempotency.complete"},
			wantOutcome: idempotency.OutcomeWon,
			wantClaim:   "idempotency.claim.result=won",
			wantSettle:  "idempotency.settle.operation=complete",
		},
		{
			name: "duplicate",
			setup: func(t *testing.T) setup {
				s := fake.New()
				if err := idempotency.Lock(t.Context(), s, key, ok); err != nil {
					t.Fatal(err)
				}
				return setup{b: s, fn: mustNotRun(t)}
			},
			wantSpans:   []string{"idempotency.lock", "idempotency.claim"},
			wantOutcome: idempotency.OutcomeDuplicate,
			wantClaim:   "idempotency.claim.result=already_done",
		},
		{
			name: "payload mismatch",
			setup: func(t *testing.T) setup {
				s := fake.New()
				if err := idempotency.Lock(t.Context(), s, key, ok, idempotency.WithPayloadFingerprint("order:qty-1")); err != nil {
					t.Fatal(err)
				}
				return setup{b: s, fn: mustNotRun(t), opts: []idempotency.LockOption{idempotency.WithPayloadFingerprint("order:qty-999")}}
			},
			wantSpans:   []string{"idempotency.lock!", "idempotency.claim"},
			wantOutcome: idempotency.OutcomePayloadMismatch,
			wantClaim:   "idempotency.claim.result=already_done",
		},
		{
			name: "in progress",
			setup: func(t *testing.T) setup {
				s := fake.New()
				if _, err := s.Claim(t.Context(), key, time.Hour); err != nil {
					t.Fatal(err)
				}
				return setup{b: s, fn: mustNotRun(t)}
			},
			wantSpans:   []string{"idempotency.lock", "idempotency.claim"},
			wantOutcome: idempotency.OutcomeInProgress,
			wantClaim:   "idempotency.claim.result=held_by_other",
		},
		{
			name: "failed",
			setup: func(t *testing.T) setup {
				return setup{b: fake.New(), fn: func(context.Context) error { return errBody }}
			},
			wantSpans:   []string{"idempotency.lock!", "idempotency.claim", "idempotency.body!", "idempotency.release"},
			wantOutcome: idempotency.OutcomeFailed,
			wantClaim:   "idempotency.claim.result=won",
			wantSettle:  "idempotency.settle.operation=release",
		},
		{
			name: "failed with the key in the body's error",
			setup: func(t *testing.T) setup {
				return setup{b: fake.New(), fn: func(context.Context) error { return fmt.Errorf("order %s: %w", key, errBody) }}
			},
			wantSpans:   []string{"idempotency.lock!", "idempotency.claim", "idempotency.body!", "idempotency.release"},
			wantOutcome: idempotency.OutcomeFailed,
			wantClaim:   "idempotency.claim.result=won",
			wantSettle:  "idempotency.settle.operation=release",
		},
		{
			name: "failed, and the release failed",
			setup: func(t *testing.T) setup {
				s := fake.New()
				b := backendFunc{claim: s.Claim, complete: s.Complete,
					release: func(_ context.Context, c store.Claim) error { return settleErr("release", c) }}
				return setup{b: b, fn: func(context.Context) error { return errBody },
					opts: []idempotency.LockOption{idempotency.WithSettleTimeout(100 * time.Millisecond)}}
			},
			wantSpans:   []string{"idempotency.lock!", "idempotency.claim", "idempotency.body!", "idempotency.release!"},
			wantOutcome: idempotency.OutcomeFailed,
			wantClaim:   "idempotency.claim.result=won",
			wantSettle:  "error.type=_OTHER,idempotency.settle.operation=release",
		},
		{
			name: "failed by a panic",
			setup: func(t *testing.T) setup {
				return setup{b: fake.New(), fn: func(context.Context) error { panic("boom") }}
			},
			wantSpans:   []string{"idempotency.lock!", "idempotency.claim", "idempotency.body!", "idempotency.release"},
			wantOutcome: idempotency.OutcomeFailed,
			wantClaim:   "idempotency.claim.result=won",
			wantSettle:  "idempotency.settle.operation=release",
		},
		{
			name: "fenced out",
			setup: func(t *testing.T) setup {
				clock := fake.NewClock(epoch)
				s := fake.New(fake.WithClock(clock.Now))
				return setup{b: s, opts: []idempotency.LockOption{idempotency.WithLease(time.Minute)},
					fn: func(ctx context.Context) error {
						// The body outruns its lease and another delivery
						// takes the key over.
						clock.Advance(2 * time.Minute)
						if res, err := s.Claim(context.WithoutCancel(ctx), key, time.Minute); err != nil || res.Outcome != store.Won {
							t.Fatalf("takeover: %v, %v", res.Outcome, err)
						}
						return nil
					}}
			},
			wantSpans:   []string{"idempotency.lock!", "idempotency.claim", "idempotency.body", "idempotency.complete!"},
			wantOutcome: idempotency.OutcomeFencedOut,
			wantClaim:   "idempotency.claim.result=won",
			wantSettle:  "idempotency.settle.operation=complete",
		},
		{
			name: "complete failed",
			setup: func(t *testing.T) setup {
				s := fake.New()
				b := backendFunc{claim: s.Claim, release: s.Release,
					complete: func(_ context.Context, c store.Claim) (bool, error) { return false, settleErr("complete", c) }}
				return setup{b: b, fn: ok, opts: []idempotency.LockOption{idempotency.WithSettleTimeout(idempotency.MinSettleTimeout)}}
			},
			wantSpans:   []string{"idempotency.lock!", "idempotency.claim", "idempotency.body", "idempotency.complete!"},
			wantOutcome: idempotency.OutcomeCompleteFailed,
			wantClaim:   "idempotency.claim.result=won",
			wantSettle:  "error.type=_OTHER,idempotency.settle.operation=complete",
		},
		{
			name: "claim failed",
			setup: func(t *testing.T) setup {
				b := backendFunc{claim: func(_ context.Context, key string, _ time.Duration) (store.Result, error) {
					return store.Result{}, claimErr(key)
				}}
				return setup{b: b, fn: mustNotRun(t)}
			},
			wantSpans:   []string{"idempotency.lock!", "idempotency.claim!"},
			wantOutcome: idempotency.OutcomeClaimFailed,
			wantClaim:   "error.type=_OTHER",
		},
		{
			name: "mutex",
			setup: func(t *testing.T) setup {
				return setup{b: fake.New(), fn: ok, mutex: true}
			},
			wantSpans:   []string{"idempotency.mutex", "idempotency.claim", "idempotency.body", "idempotency.release"},
			wantOutcome: idempotency.OutcomeWon,
			wantClaim:   "idempotency.claim.result=won",
			wantSettle:  "idempotency.settle.operation=release",
		},
		{
			name: "mutex over a done key",
			setup: func(t *testing.T) setup {
				s := fake.New()
				if err := idempotency.Lock(t.Context(), s, key, ok); err != nil {
					t.Fatal(err)
				}
				return setup{b: s, fn: mustNotRun(t), mutex: true}
			},
			wantSpans:   []string{"idempotency.mutex", "idempotency.claim"},
			wantOutcome: idempotency.OutcomeInProgress,
			wantClaim:   "idempotency.claim.result=already_done",
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := newRig(t)
			su := c.setup(t)
			opts := append(r.opts(), append(su.opts, idempotency.WithLogger(discard))...)
			// The request's own span, whose child the call's span must be.
			ctx, req := r.tp.Tracer("test").Start(t.Context(), "request")
			func() {
				defer func() { _ = recover() }() // the panicking body
				verb := idempotency.Lock
				if su.mutex {
					verb = idempotency.Mutex
				}
				_ = verb(ctx, su.b, key, su.fn, opts...)
			}()
			req.End()

			spans := r.spans()
			if spans[0].Name() != "request" {
				t.Fatalf("first span %q", spans[0].Name())
			}
			got := spans[1:]
			if diff := cmp.Diff(c.wantSpans, names(got)); diff != "" {
				t.Fatalf("spans (-want +got):\n%s", diff)
			}
			call := got[0]
			if call.Parent().SpanID() != req.SpanContext().SpanID() {
				t.Errorf("the call's span is not a child of the request's")
			}
			for _, s := range got[1:] {
				if s.Parent().SpanID() != call.SpanContext().SpanID() {
					t.Errorf("%s is not a child of the call's span", s.Name())
				}
			}
			if v, _ := attr(call, "idempotency.outcome"); v.AsString() != c.wantOutcome {
				t.Errorf("outcome %q, want %q", v.AsString(), c.wantOutcome)
			}
			won := c.wantClaim == "idempotency.claim.result=won"
			keyFree(t, got, key)
			for _, s := range got {
				if _, has := attr(s, "idempotency.key"); has {
					t.Errorf("%s carries the key without WithKeyInSpans", s.Name())
				}
				// Every span after a won claim carries its fence; none
				// does when the claim was not won.
				if fence, has := attr(s, "idempotency.fence"); has != won || (won && fence.AsInt64() < 1) {
					t.Errorf("%s: fence %v (present %v), claim won %v", s.Name(), fence.AsInt64(), has, won)
				}
			}

			want := map[string]map[string]int64{
				"idempotency.deliveries {delivery}": {"idempotency.outcome=" + c.wantOutcome: 1},
				"idempotency.claim.duration s":      {c.wantClaim: 1},
			}
			if c.wantSettle != "" {
				want["idempotency.settle.duration s"] = map[string]int64{c.wantSettle: 1}
			}
			if diff := cmp.Diff(want, r.collect(t)); diff != "" {
				t.Fatalf("metrics (-want +got):\n%s", diff)
			}
		})
	}
}

// The body's own spans are children of the body's span, and the key is
// on every span only with WithKeyInSpans (never on a metric).
func TestBodySpansNestAndKeyOnlyByOption(t *testing.T) {
	r := newRig(t)
	opts := append(r.opts(), idempotency.WithKeyInSpans())
	err := idempotency.Lock(t.Context(), fake.New(), key, func(ctx context.Context) error {
		_, s := trace.SpanFromContext(ctx).TracerProvider().Tracer("app").Start(ctx, "send to supplier")
		s.End()
		return nil
	}, opts...)
	if err != nil {
		t.Fatal(err)
	}
	spans := r.spans()
	if diff := cmp.Diff([]string{"idempotency.lock", "idempotency.claim", "idempotency.body", "send to supplier", "idempotency.complete"}, names(spans)); diff != "" {
		t.Fatalf("spans (-want +got):\n%s", diff)
	}
	if named(t, spans, "send to supplier").Parent().SpanID() != named(t, spans, "idempotency.body").SpanContext().SpanID() {
		t.Error("the body's span is not the parent of the body's own span")
	}
	for _, s := range spans {
		if s.Name() == "send to supplier" {
			continue
		}
		if v, _ := attr(s, "idempotency.key"); v.AsString() != key {
			t.Errorf("%s: key %q, want %q", s.Name(), v.AsString(), key)
		}
	}
	for name, points := range r.collect(t) {
		for attrs := range points {
			if strings.Contains(attrs, key) {
				t.Errorf("%s carries the key: %s", name, attrs)
			}
		}
	}
}

// With a no-op provider the body runs on the caller's span context, and
// nothing is recorded.
func TestNoopProviderLeavesTheContextAlone(t *testing.T) {
	r := newRig(t)
	ctx, parent := r.tp.Tracer("test").Start(t.Context(), "request")
	defer parent.End()
	var seen trace.SpanContext
	err := idempotency.Lock(ctx, fake.New(), key, func(ctx context.Context) error {
		seen = trace.SpanContextFromContext(ctx)
		return nil
	}, idempotency.WithTracerProvider(noop.NewTracerProvider()))
	if err != nil {
		t.Fatal(err)
	}
	if !seen.Equal(parent.SpanContext()) {
		t.Errorf("body saw span context %v, want the caller's %v", seen, parent.SpanContext())
	}
}

func ok(context.Context) error { return nil }

func mustNotRun(t *testing.T) func(context.Context) error {
	return func(context.Context) error {
		t.Error("the body ran")
		return nil
	}
}

// Through Idempotent, the key as the KeyFunc found it ("PO-7", before the
// prefix) is kept out of the spans too: here in a handler's error, in a
// claim error and in a payload mismatch. With WithKeyInSpans the errors
// are recorded as they are.
func TestIdempotentKeepsTheFoundKeyOutOfSpans(t *testing.T) {
	const found = "PO-7"
	for _, keyOn := range []bool{false, true} {
		r := newRig(t)
		opts := []idempotency.Option{idempotency.WithLogger(discard), idempotency.WithTracerProvider(r.tp), idempotency.WithMeterProvider(r.mp),
			idempotency.WithKey(idempotency.Attribute("po_id")), idempotency.WithKeyPrefix("orders:")}
		if keyOn {
			opts = append(opts, idempotency.WithKeyInSpans())
		}
		msg := func(data string) *pubsubtest.Message {
			return &pubsubtest.Message{ID: pubsubtest.NewID(), Data: []byte(data), Attributes: map[string]string{"po_id": found}}
		}
		s := fake.New()
		failing := func(context.Context, cloudevents.Event) error { return fmt.Errorf("order %s: supplier said no", found) }
		_ = idempotency.Idempotent(s, opts...)(failing)(t.Context(), msg(`{"qty":1}`).Event())
		_ = idempotency.Idempotent(s, opts...)(func(context.Context, cloudevents.Event) error { return nil })(t.Context(), msg(`{"qty":1}`).Event())
		_ = idempotency.Idempotent(s, opts...)(failing)(t.Context(), msg(`{"qty":2}`).Event())
		broken := backendFunc{claim: func(_ context.Context, key string, _ time.Duration) (store.Result, error) {
			return store.Result{}, fmt.Errorf("store: claim %q: unreachable", key)
		}}
		_ = idempotency.Idempotent(broken, opts...)(failing)(t.Context(), msg(`{"qty":1}`).Event())
		spans := r.spans()
		if diff := cmp.Diff([]string{
			"idempotency.lock!", "idempotency.claim", "idempotency.body!", "idempotency.release",
			"idempotency.lock", "idempotency.claim", "idempotency.body", "idempotency.complete",
			"idempotency.lock!", "idempotency.claim",
			"idempotency.lock!", "idempotency.claim!",
		}, names(spans)); diff != "" {
			t.Fatalf("spans (-want +got):\n%s", diff)
		}
		if !keyOn {
			keyFree(t, spans, found)
			continue
		}
		if d := spans[2].Status().Description; d != "order PO-7: supplier said no" {
			t.Errorf("with WithKeyInSpans, the body's status %q, want the error as it is", d)
		}
	}
}
