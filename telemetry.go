package idempotency

import (
	"context"
	"errors"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/telemetryswitch"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// InstrumentationName is the name of the tracer and of the meter this
// package takes from its providers: the OpenTelemetry instrumentation
// scope of its spans and metrics.
const InstrumentationName = "github.com/gcp-pubsub-idempotency/idempotency"

// The values of the attribute "idempotency.outcome", which the
// "idempotency.deliveries" counter and the last span of each delivery
// carry: how a call of [Lock] or [Mutex] (and so a delivery to
// [Idempotent] or [PushHandler] that reached the backend) ended.
const (
	// OutcomeWon: the claim was won and the body ran and returned nil; Lock
	// then marked the key done (Mutex released it).
	OutcomeWon = "won"
	// OutcomeDuplicate: the key was already done; the body did not run.
	OutcomeDuplicate = "duplicate"
	// OutcomeInProgress: another holder's live lease (or, for Mutex, a
	// key Lock completed) kept the body from running.
	OutcomeInProgress = "in_progress"
	// OutcomeFailed: the body returned an error or panicked; the claim was
	// released.
	OutcomeFailed = "failed"
	// OutcomeFencedOut: the body returned nil, but its claim had been taken
	// over when Lock went to complete it: the work may run twice.
	OutcomeFencedOut = "fenced_out"
	// OutcomeCompleteFailed: the body returned nil, but marking the key done
	// failed until the settle timeout.
	OutcomeCompleteFailed = "complete_failed"
	// OutcomePayloadMismatch: the key was done by a delivery with another
	// payload fingerprint; the body did not run.
	OutcomePayloadMismatch = "payload_mismatch"
	// OutcomeClaimFailed: the backend failed to claim; the body did not
	// run.
	OutcomeClaimFailed = "claim_failed"
)

// The names of this package's span attributes; see docs/telemetry.md.
const (
	attrOutcome     = "idempotency.outcome"
	attrFence       = "idempotency.fence"
	attrKey         = "idempotency.key"
	attrClaimResult = "idempotency.claim.result"
	attrOperation   = "idempotency.settle.operation"
	attrErrorType   = "error.type"
)

// WithTracerProvider sets where the spans of [Lock], [Mutex],
// [Idempotent] and [PushHandler] go. The default is the global provider,
// otel.GetTracerProvider(), looked up on every call, so a provider set
// with otel.SetTracerProvider after Idempotent was called is used. A nil
// tp means the default.
//
// Each call makes a span "idempotency.lock" (for Mutex,
// "idempotency.mutex"), a child of the span in the call's context, with
// the outcome; under it "idempotency.claim", then, when the claim was
// won, "idempotency.body" (the parent of the body's own spans) and
// "idempotency.complete" or "idempotency.release". docs/telemetry.md
// lists their attributes; the key is not among them unless
// [WithKeyInSpans] is set.
func WithTracerProvider(tp trace.TracerProvider) LockOption {
	var tc *tracerCache
	if tp != nil {
		tc = &tracerCache{}
	}
	return lockOption(func(c *lockConfig) { c.tel.tp, c.tel.tc = tp, tc })
}

// WithMeterProvider sets where the metrics of [Lock], [Mutex],
// [Idempotent] and [PushHandler] go. The default is the global provider,
// otel.GetMeterProvider(), looked up on every call, so a provider set
// with otel.SetMeterProvider after Idempotent was called is used. A nil
// mp means the default.
//
// The instruments are "idempotency.deliveries" (a counter by
// "idempotency.outcome"), "idempotency.claim.duration" and
// "idempotency.settle.duration" (histograms, in seconds): see
// docs/telemetry.md. They are made once per option value: build the
// option once and reuse it, rather than calling WithMeterProvider on
// every Lock.
func WithMeterProvider(mp metric.MeterProvider) LockOption {
	var ic *instrumentCache
	if mp != nil {
		ic = &instrumentCache{}
	}
	return lockOption(func(c *lockConfig) { c.tel.mp, c.tel.ic = mp, ic })
}

// WithKeyInSpans puts the key on every span as the attribute
// "idempotency.key". It is off by default: a key may be a business
// identifier (an order id, an email address) that does not belong in
// traces, and it is of unbounded cardinality. Metrics never carry it.
// Without it, no span carries the key anywhere: an error a span records
// (a backend's error names the key, a body's may) has the key, as stored
// and as the [KeyFunc] found it, replaced by "[key]" in its
// "exception.message" event attribute and its status description.
func WithKeyInSpans() LockOption {
	return lockOption(func(c *lockConfig) { c.tel.key = true })
}

// telemetryConfig is what the telemetry options set.
type telemetryConfig struct {
	tp  trace.TracerProvider // nil: the global one
	tc  *tracerCache         // tp's tracer, made once per option value
	mp  metric.MeterProvider // nil: the global one
	ic  *instrumentCache     // mp's instruments, made once per option value
	key bool                 // the key as a span attribute
}

// tracerCache holds the tracer of one provider, made on first use.
type tracerCache struct {
	once sync.Once
	t    trace.Tracer
}

// instrumentCache holds the instruments of one provider, made on first use.
type instrumentCache struct {
	once sync.Once
	in   *instruments
}

// globalTracer and globalInstruments hold what was made from the global
// providers, with the provider they were made from: a provider set since
// then (otel.SetTracerProvider may be called again, and only the first
// call redirects what the global provider made before it) makes them
// anew.
var (
	globalTracer      atomic.Pointer[tracerFrom]
	globalInstruments atomic.Pointer[instrumentsFrom]
)

type tracerFrom struct {
	tp trace.TracerProvider
	t  trace.Tracer
}

type instrumentsFrom struct {
	mp metric.MeterProvider
	in *instruments
}

// unsetTracerProvider is the global tracer provider as the OpenTelemetry
// API starts out, before any otel.SetTracerProvider, when it is that
// (nil otherwise): every span it makes until then is a no-op that
// passes its parent's span context on. While otel.GetTracerProvider still
// returns it, tracer returns nil and no span is started at all, which
// saves each call the allocations of three no-op spans.
var unsetTracerProvider = func() trace.TracerProvider {
	tp := otel.GetTracerProvider()
	if t := reflect.TypeOf(tp); t != nil && t.Kind() == reflect.Pointer &&
		t.Elem().PkgPath() == "go.opentelemetry.io/otel/internal/global" && t.Elem().Name() == "tracerProvider" {
		return tp
	}
	return nil
}()

// tracer returns the tracer spans go to; nil when they would all be
// no-ops (see unsetTracerProvider).
func (c *telemetryConfig) tracer() trace.Tracer {
	if c.tp != nil {
		c.tc.once.Do(func() { c.tc.t = c.tp.Tracer(InstrumentationName) })
		return c.tc.t
	}
	tp := otel.GetTracerProvider()
	if unsetTracerProvider != nil && tp == unsetTracerProvider {
		return nil
	}
	if g := globalTracer.Load(); g != nil && same(g.tp, tp) {
		return g.t
	}
	t := tp.Tracer(InstrumentationName)
	globalTracer.Store(&tracerFrom{tp: tp, t: t})
	return t
}

// instruments returns the instruments metrics go to.
func (c *telemetryConfig) instruments() *instruments {
	if c.mp != nil {
		c.ic.once.Do(func() { c.ic.in = newInstruments(c.mp) })
		return c.ic.in
	}
	mp := otel.GetMeterProvider()
	if g := globalInstruments.Load(); g != nil && same(g.mp, mp) {
		return g.in
	}
	in := newInstruments(mp)
	globalInstruments.Store(&instrumentsFrom{mp: mp, in: in})
	return in
}

// same reports whether a and b are the same provider; false when they
// cannot be compared (a provider whose type holds a slice or a map).
func same(a, b any) (eq bool) {
	defer func() {
		if recover() != nil {
			eq = false
		}
	}()
	return a == b
}

// instruments are the metrics of one meter provider.
type instruments struct {
	deliveries metric.Int64Counter
	claim      metric.Float64Histogram
	settle     metric.Float64Histogram
}

// durationBuckets are the histogram boundaries, in seconds, from a
// millisecond (an in-memory or nearby store) to the default settle
// timeout: the SDK's default boundaries are meant for milliseconds.
var durationBuckets = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

func newInstruments(mp metric.MeterProvider) *instruments {
	m := mp.Meter(InstrumentationName)
	in := &instruments{}
	var err error
	if in.deliveries, err = m.Int64Counter("idempotency.deliveries",
		metric.WithUnit("{delivery}"),
		metric.WithDescription("Calls of Lock or Mutex (deliveries that reached the backend) by outcome.")); err != nil {
		otel.Handle(err)
	}
	if in.claim, err = m.Float64Histogram("idempotency.claim.duration",
		metric.WithUnit("s"),
		metric.WithDescription("Duration of the backend's Claim call."),
		metric.WithExplicitBucketBoundaries(durationBuckets...)); err != nil {
		otel.Handle(err)
	}
	if in.settle, err = m.Float64Histogram("idempotency.settle.duration",
		metric.WithUnit("s"),
		metric.WithDescription("Duration of the Complete or Release after the body, retries included."),
		metric.WithExplicitBucketBoundaries(durationBuckets...)); err != nil {
		otel.Handle(err)
	}
	return in
}

// The measurement options, made once: an attribute set per value.
var (
	outcomeOpts = map[string][]metric.AddOption{}
	claimOpts   = map[string][]metric.RecordOption{}
	settleOpts  = map[[2]string][]metric.RecordOption{}
)

func init() {
	for _, o := range []string{OutcomeWon, OutcomeDuplicate, OutcomeInProgress, OutcomeFailed,
		OutcomeFencedOut, OutcomeCompleteFailed, OutcomePayloadMismatch, OutcomeClaimFailed} {
		outcomeOpts[o] = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(attribute.String(attrOutcome, o)))}
	}
	for _, r := range []string{claimWon, claimDone, claimHeld} {
		claimOpts[r] = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(attribute.String(attrClaimResult, r)))}
	}
	claimOpts[""] = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(attribute.String(attrErrorType, "_OTHER")))}
	for _, op := range []string{opComplete, opRelease} {
		settleOpts[[2]string{op, ""}] = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(attribute.String(attrOperation, op)))}
		settleOpts[[2]string{op, "_OTHER"}] = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(
			attribute.String(attrOperation, op), attribute.String(attrErrorType, "_OTHER")))}
	}
}

// The values of "idempotency.claim.result" and of
// "idempotency.settle.operation".
const (
	claimWon   = "won"
	claimDone  = "already_done"
	claimHeld  = "held_by_other"
	opComplete = "complete"
	opRelease  = "release"
)

// noInstruments measure nothing.
var noInstruments instruments

// errBodyPanicked is what the body span records for a body that panicked
// or called runtime.Goexit.
var errBodyPanicked = errors.New("idempotency: the body panicked or exited")

// tracker follows one call of run through its spans and metrics.
type tracker struct {
	tracer trace.Tracer
	in     *instruments
	key    string
	found  string // the key as the KeyFunc found it ("" for Lock and Mutex)
	keyOn  bool
	// noop: the tracer made no span of its own for the call (a no-op
	// provider, or the global one before any is set): the child spans are
	// skipped, as they would be no-ops too.
	noop bool
	// timed: the claim histogram takes measurements, so both histograms
	// are timed.
	timed bool

	call     trace.Span // the span of the whole call
	span     trace.Span // the open child span: the claim's, the body's or the settle call's
	start    time.Time
	settleOp string
	fence    int64
	bodyOn   bool  // the body started
	bodyErr  error // what it returned
	outcome  string
}

// begin starts the call's span, "idempotency.lock" or
// "idempotency.mutex", on ctx and returns ctx with it.
func (t *tracker) begin(ctx context.Context, cfg *lockConfig, key, found string, mutex bool) context.Context {
	if telemetryswitch.Off.Load() { // a benchmark's baseline
		t.in, t.call, t.noop = &noInstruments, noop.Span{}, true
		return ctx
	}
	t.tracer = cfg.tel.tracer()
	t.in = cfg.tel.instruments()
	t.key, t.found, t.keyOn = key, found, cfg.tel.key
	t.timed = t.in.claim != nil && t.in.settle != nil && t.in.claim.Enabled(ctx)
	if t.tracer == nil {
		t.call, t.noop = noop.Span{}, true
		return ctx
	}
	name := "idempotency.lock"
	if mutex {
		name = "idempotency.mutex"
	}
	parent := trace.SpanContextFromContext(ctx)
	cctx, span := t.tracer.Start(ctx, name)
	t.call = span
	if !span.IsRecording() && span.SpanContext().SpanID() == parent.SpanID() {
		// A no-op tracer hands the parent's span context on: nothing to
		// record, and the context can stay as it was.
		t.noop = true
		cctx = ctx
	}
	if t.keyOn && span.IsRecording() {
		span.SetAttributes(attribute.String(attrKey, key))
	}
	return cctx
}

// child starts a child span of the call's span on ctx.
func (t *tracker) child(ctx context.Context, name string) context.Context {
	if t.noop {
		return ctx
	}
	ctx, t.span = t.tracer.Start(ctx, name)
	if t.span.IsRecording() {
		if t.keyOn {
			t.span.SetAttributes(attribute.String(attrKey, t.key))
		}
		if t.fence != 0 {
			t.span.SetAttributes(attribute.Int64(attrFence, t.fence))
		}
	}
	return ctx
}

// endChild ends the open child span, with err as its error when not nil.
func (t *tracker) endChild(err error) {
	if t.span == nil {
		return
	}
	if err != nil {
		t.recordError(t.span, err)
	}
	t.span.End()
	t.span = nil
}

// recordError records err on s, as an exception event and as the
// status: as span.RecordError would, except that without WithKeyInSpans
// the key is replaced by redactedKey wherever the message holds it (a
// backend's error names the key, and a body's may).
func (t *tracker) recordError(s trace.Span, err error) {
	msg := err.Error()
	if red := t.redact(msg); red != msg {
		s.AddEvent("exception", trace.WithAttributes(
			attribute.String("exception.type", typeName(err)),
			attribute.String("exception.message", red)))
		s.SetStatus(codes.Error, red)
		return
	}
	s.RecordError(err)
	s.SetStatus(codes.Error, msg)
}

// redactedKey stands for the key in what a span records of an error.
const redactedKey = "[key]"

// redact returns msg with the key (as stored, and as the KeyFunc found
// it; raw, and as %q escapes it) replaced by redactedKey, unless the key
// may be on spans.
func (t *tracker) redact(msg string) string {
	if t.keyOn {
		return msg
	}
	for _, k := range [2]string{t.key, t.found} {
		if k == "" {
			continue
		}
		if q := strconv.Quote(k); q[1:len(q)-1] != k {
			msg = strings.ReplaceAll(msg, q[1:len(q)-1], redactedKey)
		}
		msg = strings.ReplaceAll(msg, k, redactedKey)
	}
	return msg
}

// typeName names err's type as the OpenTelemetry SDK's RecordError does
// in "exception.type".
func typeName(err error) string {
	ty := reflect.TypeOf(err)
	if ty.PkgPath() == "" && ty.Name() == "" {
		return ty.String()
	}
	return ty.PkgPath() + "." + ty.Name()
}

// claim starts the claim's span and clock; it returns the context to
// claim on.
func (t *tracker) claim(ctx context.Context) context.Context {
	if t.timed {
		t.start = time.Now()
	}
	return t.child(ctx, "idempotency.claim")
}

// claimed records what Claim answered and ends the claim's span.
func (t *tracker) claimed(ctx context.Context, res store.Result, err error) {
	r := ""
	if err == nil {
		r = claimResult(res.Outcome)
	}
	if t.timed {
		if opts, ok := claimOpts[r]; ok {
			t.in.claim.Record(ctx, time.Since(t.start).Seconds(), opts...)
		}
	}
	if err == nil && res.Outcome == store.Won {
		t.fence = res.Claim.Fence
	}
	if t.span != nil && t.span.IsRecording() && err == nil {
		t.span.SetAttributes(attribute.String(attrClaimResult, r))
		if t.fence != 0 {
			t.span.SetAttributes(attribute.Int64(attrFence, t.fence))
		}
	}
	t.endChild(err)
}

func claimResult(o store.Outcome) string {
	switch o {
	case store.Won:
		return claimWon
	case store.AlreadyDone:
		return claimDone
	case store.HeldByOther:
		return claimHeld
	}
	return o.String()
}

// body starts the body's span on ctx, the body's context.
func (t *tracker) body(ctx context.Context) context.Context {
	t.bodyOn = true
	return t.child(ctx, "idempotency.body")
}

// bodyEnded ends the body's span with what the body returned.
func (t *tracker) bodyEnded(err error) {
	t.bodyErr = err
	t.endChild(err)
}

// settling starts the span and clock of the Complete or Release (op)
// after the body; it returns the context to settle on.
func (t *tracker) settling(ctx context.Context, op string) context.Context {
	t.settleOp = op
	if t.timed {
		t.start = time.Now()
	}
	if op == opRelease {
		return t.child(ctx, "idempotency.release")
	}
	return t.child(ctx, "idempotency.complete")
}

// settled ends the settle call's span. done is what Complete answered
// (true for a Release); err is the error that outlasted the retries.
func (t *tracker) settled(ctx context.Context, done bool, err error) {
	switch {
	case t.bodyErr != nil:
		t.outcome = OutcomeFailed
	case t.settleOp == opRelease:
		t.outcome = OutcomeWon // Mutex
	case err != nil:
		t.outcome = OutcomeCompleteFailed
	case !done:
		t.outcome = OutcomeFencedOut
	default:
		t.outcome = OutcomeWon
	}
	if t.timed {
		e := ""
		if err != nil {
			e = "_OTHER"
		}
		t.in.settle.Record(ctx, time.Since(t.start).Seconds(), settleOpts[[2]string{t.settleOp, e}]...)
	}
	if err == nil && !done {
		err = errFencedOut
	}
	t.endChild(err)
}

// superseded ends the settle span of a LockTx whose claim was superseded
// before its transaction committed: fenced out, like a Complete that
// found the claim replaced, whatever the body returned (under a
// heartbeat, its cancelled context's error).
func (t *tracker) superseded(ctx context.Context) {
	t.bodyErr = nil
	t.settled(ctx, false, nil)
}

// errFencedOut is what the complete span records for a claim that was
// fenced out.
var errFencedOut = errors.New("idempotency: the claim was fenced out: its lease lapsed and another delivery claimed the key, or it was released, before the work was marked done")

// end counts the call by its outcome and ends its span. *errp is run's
// error result, which a panic leaves unset.
func (t *tracker) end(ctx context.Context, errp *error) {
	err := *errp
	if t.span != nil { // a panic in the backend or in a hook
		t.endChild(errBodyPanicked)
	}
	switch {
	case t.outcome != "":
	case t.bodyOn: // the body panicked, and the release after it did not return
		t.outcome = OutcomeFailed
	default:
		t.outcome = ownOutcome(err)
	}
	if t.in.deliveries != nil {
		t.in.deliveries.Add(ctx, 1, outcomeOpts[t.outcome]...)
	}
	s := t.call
	if s.IsRecording() {
		s.SetAttributes(attribute.String(attrOutcome, t.outcome))
		if t.fence != 0 {
			s.SetAttributes(attribute.Int64(attrFence, t.fence))
		}
		switch t.outcome {
		case OutcomeWon, OutcomeDuplicate, OutcomeInProgress:
		case OutcomeFailed:
			if t.bodyErr != nil {
				s.SetStatus(codes.Error, t.redact(t.bodyErr.Error()))
			} else {
				s.SetStatus(codes.Error, errBodyPanicked.Error())
			}
		case OutcomeFencedOut:
			s.SetStatus(codes.Error, errFencedOut.Error())
		case OutcomeCompleteFailed:
			s.SetStatus(codes.Error, "idempotency: the body ran but marking the key done failed")
		default:
			if err != nil {
				t.recordError(s, err)
			} else {
				s.SetStatus(codes.Error, t.outcome)
			}
		}
	}
	s.End()
}

// ownOutcome classifies the error of a call whose body did not run.
func ownOutcome(err error) string {
	switch err.(type) {
	case *DuplicateError:
		return OutcomeDuplicate
	case *InProgressError:
		return OutcomeInProgress
	case *PayloadMismatchError:
		return OutcomePayloadMismatch
	}
	return OutcomeClaimFailed
}

// MessageTraceAttributePrefix starts the names of the message attributes
// in which Google's Pub/Sub client libraries, with OpenTelemetry tracing
// enabled, send the publisher's W3C trace context: "googclient_traceparent"
// and "googclient_tracestate".
const MessageTraceAttributePrefix = "googclient_"

// WithTraceFromMessage makes [Idempotent] and [PushHandler] continue the
// publisher's trace: when the request's context carries no span context,
// the W3C trace context that a Pub/Sub client library put in the message's
// attributes ([MessageTraceAttributePrefix] + "traceparent", and
// "tracestate") becomes the remote parent of the delivery's spans, and so
// reaches the handler's context. A request that carries a span context
// (PushHandler behind otelhttp, or with a propagator set; see
// docs/telemetry.md) keeps it. A message without a valid traceparent
// changes nothing.
//
// It is off by default because it costs a decoding of the event's data
// per delivery (the attributes are inside it), and because it makes
// every delivery part of its publisher's trace, which a sampler that
// follows its parent then samples as the publisher did. The functions
// framework passes no trace context to a CloudEvent function, so behind
// it this is the only way to join a trace.
func WithTraceFromMessage() Option {
	return option(func(c *config) { c.msgTrace = true })
}

// messageTrace returns ctx with the trace context of e's message as its
// remote parent, when ctx has no span context and the message has one.
func messageTrace(ctx context.Context, e event.Event) context.Context {
	if trace.SpanContextFromContext(ctx).IsValid() {
		return ctx
	}
	m, err := ParsePubSub(e)
	if err != nil || m.Message.Attributes[MessageTraceAttributePrefix+"traceparent"] == "" {
		return ctx
	}
	return propagation.TraceContext{}.Extract(ctx, attributeCarrier(m.Message.Attributes))
}

// attributeCarrier reads a trace context from message attributes, under
// MessageTraceAttributePrefix.
type attributeCarrier map[string]string

func (c attributeCarrier) Get(key string) string { return c[MessageTraceAttributePrefix+key] }

func (c attributeCarrier) Set(string, string) {}

func (c attributeCarrier) Keys() []string {
	var keys []string
	for k := range c {
		if rest, ok := strings.CutPrefix(k, MessageTraceAttributePrefix); ok {
			keys = append(keys, rest)
		}
	}
	return keys
}

// requestTrace returns ctx with the trace context of r's headers, read by
// the global propagator (otel.GetTextMapPropagator, which propagates
// nothing until the program sets one), when ctx has no span context.
func requestTrace(ctx context.Context, r *http.Request) context.Context {
	if trace.SpanContextFromContext(ctx).IsValid() {
		return ctx
	}
	return otel.GetTextMapPropagator().Extract(ctx, propagation.HeaderCarrier(r.Header))
}
