package idempotency

import (
	"io"
	"log/slog"
)

// NewLogHandler returns a slog.Handler that writes one JSON object per line
// in the shape Cloud Logging reads from a Cloud Run or Cloud Functions
// container's stdout or stderr: "severity" (DEBUG, INFO, WARNING, ERROR)
// and "message", beside the record's attributes. Records below level are
// dropped; a nil level means slog.LevelInfo.
//
//	slog.SetDefault(slog.New(idempotency.NewLogHandler(os.Stderr, nil)))
func NewLogHandler(w io.Writer, level slog.Leveler) slog.Handler {
	return slog.NewJSONHandler(w, &slog.HandlerOptions{
		Level: level,
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			if len(groups) > 0 {
				return a
			}
			switch a.Key {
			case slog.MessageKey:
				a.Key = "message"
			case slog.LevelKey:
				a.Key = "severity"
				a.Value = slog.StringValue(severity(a.Value.Any()))
			}
			return a
		},
	})
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
