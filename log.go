package idempotency

import (
	"context"
	"io"
	"log/slog"
	"os"

	"go.opentelemetry.io/otel/trace"
)

// The fields of a structured log line that Cloud Logging reads as the
// entry's trace, span and sampling decision, and so shows the line beside
// the trace in Cloud Trace and groups it with its request.
const (
	LogTraceKey   = "logging.googleapis.com/trace"
	LogSpanIDKey  = "logging.googleapis.com/spanId"
	LogSampledKey = "logging.googleapis.com/trace_sampled"
)

// LogOption configures [NewLogHandler].
type LogOption func(*logConfig)

type logConfig struct {
	project string
}

// WithLogProject sets the Google Cloud project in the trace field
// NewLogHandler writes, "projects/PROJECT/traces/TRACE_ID": the project
// whose Cloud Trace holds the trace. The default is the environment
// variable GOOGLE_CLOUD_PROJECT when NewLogHandler is called.
func WithLogProject(project string) LogOption {
	return func(c *logConfig) { c.project = project }
}

// NewLogHandler returns a slog.Handler that writes one JSON object per line
// in the shape Cloud Logging reads from a Cloud Run or Cloud Functions
// container's stdout or stderr: "severity" (DEBUG, INFO, WARNING, ERROR)
// and "message", beside the record's attributes. Records below level are
// dropped; a nil level means slog.LevelInfo.
//
//	slog.SetDefault(slog.New(idempotency.NewLogHandler(os.Stderr, nil)))
//
// When the context of a record (the ctx of Logger.InfoContext and the
// like) carries a valid OpenTelemetry span context, the line also gets
// [LogTraceKey] ("projects/PROJECT/traces/TRACE_ID"), [LogSpanIDKey] and
// [LogSampledKey], at the top level whatever groups the logger has: Cloud
// Logging then files the line under that trace and span. The project is
// that of [WithLogProject], else GOOGLE_CLOUD_PROJECT; with neither, the
// trace field is left out and only the span id and the sampling decision
// are written. The lines [Lock] and [Mutex] log while a call runs carry
// the context of the call's span (see docs/telemetry.md).
func NewLogHandler(w io.Writer, level slog.Leveler, opts ...LogOption) slog.Handler {
	cfg := logConfig{project: os.Getenv("GOOGLE_CLOUD_PROJECT")}
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	base := slog.NewJSONHandler(w, &slog.HandlerOptions{
		Level: level,
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			if len(groups) > 0 {
				return a
			}
			switch a.Key {
			case slog.MessageKey, slog.LevelKey:
				if a.Value.Kind() == slog.KindAny {
					if c, ok := a.Value.Any().(callerValue); ok {
						a.Value = c.v // the caller's own, not slog's
						return a
					}
				}
				if a.Key == slog.MessageKey {
					a.Key = "message"
				} else {
					a.Key = "severity"
					a.Value = slog.StringValue(severity(a.Value.Any()))
				}
			}
			return a
		},
	})
	h := &cloudHandler{base: base, cur: base}
	if cfg.project != "" {
		h.tracePrefix = "projects/" + cfg.project + "/traces/"
	}
	return h
}

// cloudHandler adds the trace fields to the records of a JSON handler.
// The fields must sit at the top level, where Cloud Logging looks for
// them, so a handler with a group open cannot add them to the record (the
// JSON handler would write them inside the group): it replays its
// WithAttrs and WithGroup calls on base, after the trace fields.
type cloudHandler struct {
	base        slog.Handler // the JSON handler, with no attrs or groups
	cur         slog.Handler // base with ops applied
	ops         []logOp
	grouped     bool // ops open a group
	tracePrefix string
}

// logOp is one WithAttrs (group empty) or WithGroup call.
type logOp struct {
	attrs []slog.Attr
	group string
}

func (h *cloudHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.cur.Enabled(ctx, l)
}

func (h *cloudHandler) Handle(ctx context.Context, r slog.Record) error {
	if !h.grouped {
		r = markRecord(r)
	}
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return h.cur.Handle(ctx, r)
	}
	fields := make([]slog.Attr, 0, 3)
	if h.tracePrefix != "" {
		fields = append(fields, slog.String(LogTraceKey, h.tracePrefix+sc.TraceID().String()))
	}
	fields = append(fields, slog.String(LogSpanIDKey, sc.SpanID().String()), slog.Bool(LogSampledKey, sc.IsSampled()))
	if !h.grouped {
		r.AddAttrs(fields...)
		return h.cur.Handle(ctx, r)
	}
	out := h.base.WithAttrs(fields)
	for _, op := range h.ops {
		if op.group != "" {
			out = out.WithGroup(op.group)
		} else {
			out = out.WithAttrs(op.attrs)
		}
	}
	return out.Handle(ctx, r)
}

func (h *cloudHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	if len(attrs) == 0 {
		return h
	}
	if !h.grouped {
		attrs, _ = markAttrs(attrs)
	}
	return h.with(logOp{attrs: attrs}, h.cur.WithAttrs(attrs))
}

func (h *cloudHandler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	return h.with(logOp{group: name}, h.cur.WithGroup(name))
}

func (h *cloudHandler) with(op logOp, cur slog.Handler) *cloudHandler {
	n := *h
	n.cur = cur
	n.ops = append(append([]logOp(nil), h.ops...), op)
	n.grouped = h.grouped || op.group != ""
	return &n
}

// callerValue holds the value of a caller's top-level attribute whose key
// is slog's level or message key: the JSON handler passes slog's own level
// and message to ReplaceAttr under the same keys, and a caller's value,
// once wrapped in a type no caller can make, is told apart from them by
// its type, whatever its key and value.
type callerValue struct{ v slog.Value }

// markAttr wraps a's value in a callerValue when a reaches ReplaceAttr
// with slog's level or message key at the top level: under that key, or
// inlined from a group without a name. A group under such a key is
// written as an object, never passed to ReplaceAttr, and stays as it is.
func markAttr(a slog.Attr) (slog.Attr, bool) {
	switch a.Key {
	case slog.LevelKey, slog.MessageKey:
		v := a.Value.Resolve()
		if v.Kind() == slog.KindGroup {
			return a, false
		}
		return slog.Attr{Key: a.Key, Value: slog.AnyValue(callerValue{v})}, true
	case "":
		v := a.Value.Resolve()
		if v.Kind() != slog.KindGroup {
			return a, false
		}
		if marked, ok := markAttrs(v.Group()); ok {
			return slog.Attr{Value: slog.GroupValue(marked...)}, true
		}
	}
	return a, false
}

// markAttrs returns attrs with markAttr applied, and whether any changed:
// attrs itself when none did, else a copy.
func markAttrs(attrs []slog.Attr) ([]slog.Attr, bool) {
	out, changed := attrs, false
	for i, a := range attrs {
		if m, ok := markAttr(a); ok {
			if !changed {
				out, changed = append([]slog.Attr(nil), attrs...), true
			}
			out[i] = m
		}
	}
	return out, changed
}

// markRecord returns r with markAttr applied to its attributes: r itself
// when none needs it.
func markRecord(r slog.Record) slog.Record {
	need := false
	r.Attrs(func(a slog.Attr) bool {
		_, need = markAttr(a)
		return !need
	})
	if !need {
		return r
	}
	out := slog.NewRecord(r.Time, r.Level, r.Message, r.PC)
	r.Attrs(func(a slog.Attr) bool {
		a, _ = markAttr(a)
		out.AddAttrs(a)
		return true
	})
	return out
}

func severity(v any) string {
	l, _ := v.(slog.Level)
	switch {
	case l >= slog.LevelError:
		return "ERROR"
	case l >= slog.LevelWarn:
		return "WARNING"
	case l >= slog.LevelInfo:
		return "INFO"
	}
	return "DEBUG"
}
