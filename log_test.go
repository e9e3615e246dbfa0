package idempotency_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/google/go-cmp/cmp"

	"github.com/gcp-pubsub-idempotency/idempotency"
)

func TestNewLogHandlerSpeaksCloudLogging(t *testing.T) {
	l := &logs{}
	logger := slog.New(idempotency.NewLogHandler(l, slog.LevelDebug))
	logger.Warn("held", "key", "k")
	logger.Error("broken")
	logger.Debug("detail")
	logger.WithGroup("g").Info("grouped", "level", "x")
	var got []string
	for _, r := range l.records(t) {
		got = append(got, r["severity"].(string)+":"+r["message"].(string))
	}
	if want := []string{"WARNING:held", "ERROR:broken", "DEBUG:detail", "INFO:grouped"}; !cmp.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

// A record whose context carries a span context gets Cloud Logging's
// trace fields at the top level, with or without groups; one without
// gets none. The project comes from WithLogProject, else
// GOOGLE_CLOUD_PROJECT; without one, the trace field is left out.
func TestNewLogHandlerCorrelatesWithTheTrace(t *testing.T) {
	traceID, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	spanID, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	sampled := trace.ContextWithSpanContext(t.Context(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled,
	}))
	unsampled := trace.ContextWithRemoteSpanContext(t.Context(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: traceID, SpanID: spanID, Remote: true,
	}))
	const wantTrace = "projects/env-project/traces/4bf92f3577b34da6a3ce929d0e0e4736"
	t.Setenv("GOOGLE_CLOUD_PROJECT", "env-project")

	l := &logs{}
	logger := slog.New(idempotency.NewLogHandler(l, nil))
	logger.InfoContext(sampled, "top", "k", "v")
	logger.InfoContext(t.Context(), "no span")
	logger.With("a", 1).WithGroup("g").With("b", 2).WarnContext(unsampled, "grouped", "c", 3)
	slog.New(idempotency.NewLogHandler(l, nil, idempotency.WithLogProject("opt-project"))).InfoContext(sampled, "option")
	t.Setenv("GOOGLE_CLOUD_PROJECT", "")
	slog.New(idempotency.NewLogHandler(l, nil)).InfoContext(sampled, "no project")

	recs := l.records(t)
	if len(recs) != 5 {
		t.Fatalf("%d records: %v", len(recs), recs)
	}
	fields := func(r map[string]any) []any {
		return []any{r[idempotency.LogTraceKey], r[idempotency.LogSpanIDKey], r[idempotency.LogSampledKey]}
	}
	want := [][]any{
		{wantTrace, "00f067aa0ba902b7", true},
		{nil, nil, nil},
		{wantTrace, "00f067aa0ba902b7", false},
		{"projects/opt-project/traces/4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", true},
		{nil, "00f067aa0ba902b7", true},
	}
	for i, r := range recs {
		if diff := cmp.Diff(want[i], fields(r)); diff != "" {
			t.Errorf("record %d %q (-want +got):\n%s", i, r["message"], diff)
		}
	}
	g := recs[2]
	if g["a"] != 1.0 || g["severity"] != "WARNING" || !cmp.Equal(g["g"], map[string]any{"b": 2.0, "c": 3.0}) {
		t.Errorf("grouped record %v: attrs and groups are not where the logger put them", g)
	}
	if recs[0]["k"] != "v" {
		t.Errorf("record 0 lost its attribute: %v", recs[0])
	}
}

// The lines Lock logs while a call runs carry the trace context (the
// call's span with an SDK provider): here the fenced-out ERROR.
func TestLockLogsCarryTheTraceContext(t *testing.T) {
	l := &logs{}
	logger := slog.New(idempotency.NewLogHandler(l, nil, idempotency.WithLogProject("p")))
	traceID, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	spanID, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithRemoteSpanContext(t.Context(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled, Remote: true,
	}))
	s, clock := newStore(t)
	err := idempotency.Lock(ctx, s, "k", func(ctx context.Context) error {
		clock.Advance(time.Hour)
		if _, err := s.Claim(context.WithoutCancel(ctx), "k", time.Minute); err != nil {
			t.Fatal(err)
		}
		return nil
	}, idempotency.WithLogger(logger), idempotency.WithLease(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	recs := l.records(t)
	if len(recs) != 1 || recs[0]["severity"] != "ERROR" {
		t.Fatalf("records %v, want the fenced-out error", recs)
	}
	if recs[0][idempotency.LogTraceKey] != "projects/p/traces/4bf92f3577b34da6a3ce929d0e0e4736" || recs[0][idempotency.LogSpanIDKey] == nil {
		t.Errorf("the error is not filed under the request's trace: %v", recs[0])
	}
}

// keysOf returns the top-level keys of a JSON object line, in order,
// repeated ones included (a map would keep only the last).
func keysOf(t *testing.T, line []byte) []string {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(line))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("line %q is not an object: %v", line, err)
	}
	var keys []string
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatal(err)
		}
		keys = append(keys, tok.(string))
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			t.Fatal(err)
		}
	}
	return keys
}

// levelName is a LogValuer that resolves to a string.
type levelName string

func (n levelName) LogValue() slog.Value { return slog.StringValue(string(n)) }

// Only slog's own level and message become "severity" and "message": a
// caller's attribute that happens to be called "level" or "msg" keeps its
// key and value, at the top level, inlined from a group without a name,
// added by With, or behind a LogValuer, with or without trace fields. On
// main its ReplaceAttr renamed it too: l.Error("payment failed", "level",
// "gold") wrote "severity":"ERROR" and then "severity":"INFO", and Cloud
// Logging, which keeps the last, read an error as INFO.
func TestNewLogHandlerRenamesOnlySlogsOwnLevelAndMessage(t *testing.T) {
	traceID, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	spanID, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	traced := trace.ContextWithSpanContext(t.Context(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled,
	}))
	for _, ctx := range []context.Context{t.Context(), traced} {
		l := &logs{}
		logger := slog.New(idempotency.NewLogHandler(l, slog.LevelDebug, idempotency.WithLogProject("p")))
		logger.ErrorContext(ctx, "payment failed", "level", "gold")
		logger.ErrorContext(ctx, "payment failed", "msg", "card declined")
		logger.ErrorContext(ctx, "payment failed", "level", slog.LevelDebug)
		logger.ErrorContext(ctx, "payment failed", slog.Group("", "level", "gold"))
		logger.ErrorContext(ctx, "payment failed", "level", levelName("gold"))
		logger.With("level", "gold").ErrorContext(ctx, "payment failed")
		logger.With(slog.Group("", slog.String("msg", "card declined"))).ErrorContext(ctx, "payment failed")
		logger.With("level", "gold").WithGroup("g").ErrorContext(ctx, "payment failed", "level", "silver")
		want := []map[string]any{
			{"level": "gold"},
			{"msg": "card declined"},
			{"level": "DEBUG"},
			{"level": "gold"},
			{"level": "gold"},
			{"level": "gold"},
			{"msg": "card declined"},
			{"level": "gold", "g": map[string]any{"level": "silver"}},
		}
		lines := bytes.Split(bytes.TrimSpace(l.buf.Bytes()), []byte("\n"))
		if len(lines) != len(want) {
			t.Fatalf("%d lines, want %d:\n%s", len(lines), len(want), l.buf.String())
		}
		for i, line := range lines {
			seen := map[string]int{}
			for _, k := range keysOf(t, line) {
				seen[k]++
			}
			if seen["severity"] != 1 || seen["message"] != 1 {
				t.Errorf("line %d %s: %d severity and %d message keys, want one each", i, line, seen["severity"], seen["message"])
			}
			var rec map[string]any
			if err := json.Unmarshal(line, &rec); err != nil {
				t.Fatal(err)
			}
			if rec["severity"] != "ERROR" || rec["message"] != "payment failed" {
				t.Errorf("line %d %s: not the ERROR \"payment failed\"", i, line)
			}
			for k, v := range want[i] {
				if !cmp.Equal(rec[k], v) {
					t.Errorf("line %d %s: %s is %v, want the caller's %v", i, line, k, rec[k], v)
				}
			}
			if (ctx == traced) != (rec[idempotency.LogSpanIDKey] != nil) {
				t.Errorf("line %d %s: trace fields wrong", i, line)
			}
		}
	}
}

// An empty group without a name, and a group under the key "level", are
// written as slog writes them, beside one severity.
func TestNewLogHandlerKeepsGroupsNamedLikeTheLevel(t *testing.T) {
	l := &logs{}
	logger := slog.New(idempotency.NewLogHandler(l, nil))
	logger.Error("payment failed", slog.Group(""), slog.Group("level", "tier", "gold"))
	recs := l.records(t)
	if len(recs) != 1 || recs[0]["severity"] != "ERROR" || !cmp.Equal(recs[0]["level"], map[string]any{"tier": "gold"}) {
		t.Fatalf("records %v", recs)
	}
	if k := keysOf(t, bytes.TrimSpace(l.buf.Bytes())); len(k) != 4 {
		t.Fatalf("keys %v, want time, severity, message, level", k)
	}
}
