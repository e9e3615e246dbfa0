// Package pulltest holds what the pull module's tests share with its
// tests on real components (pull/internal/realtest): running a
// subscriber until its deliveries are in, counting them, and reading the
// JSON log lines.
package pulltest

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"cloud.google.com/go/pubsub/v2"
)

// Receive runs sub.Receive with cb until done, called after each
// callback returned with the message it got, reports true; it fails the
// test when that takes a minute.
func Receive(t *testing.T, sub *pubsub.Subscriber, cb func(context.Context, *pubsub.Message), done func(m *pubsub.Message) bool) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	finished := make(chan struct{})
	var once sync.Once
	var mu sync.Mutex // done runs once at a time
	errc := make(chan error, 1)
	go func() {
		errc <- sub.Receive(ctx, func(ctx context.Context, m *pubsub.Message) {
			cb(ctx, m)
			mu.Lock()
			defer mu.Unlock()
			if done(m) {
				once.Do(func() { close(finished) })
			}
		})
	}()
	select {
	case <-finished:
	case err := <-errc:
		t.Fatalf("Receive returned early: %v", err)
	case <-time.After(time.Minute):
		t.Fatal("the deliveries did not come within a minute")
	}
	cancel()
	if err := <-errc; err != nil {
		t.Fatalf("Receive: %v", err)
	}
}

// Logs is a JSON slog handler's output, read line by line.
type Logs struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p to the output.
func (l *Logs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// NewLogs returns a logger of JSON lines at every level, and its output.
func NewLogs() (*Logs, *slog.Logger) {
	l := &Logs{}
	return l, slog.New(slog.NewJSONHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// Find returns the records of the level whose message holds msg.
func (l *Logs) Find(t *testing.T, level, msg string) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(l.buf.String()), "\n") {
		if line == "" {
			continue
		}
		var r map[string]any
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if r["level"] == level && strings.Contains(r["msg"].(string), msg) {
			out = append(out, r)
		}
	}
	return out
}

// Counter counts the callbacks that returned, per message id.
type Counter struct {
	mu sync.Mutex
	n  map[string]int
}

// Add counts a returned callback of m; it returns the count of m's
// callbacks and of all.
func (c *Counter) Add(m *pubsub.Message) (this, total int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[m.ID]++
	for _, v := range c.n {
		total += v
	}
	return c.n[m.ID], total
}

// Of returns the count of the callbacks of the message id.
func (c *Counter) Of(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[id]
}
