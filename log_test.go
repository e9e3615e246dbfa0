package idempotency_test

import (
	"log/slog"
	"testing"

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
