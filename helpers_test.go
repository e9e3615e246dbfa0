package idempotency_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var epoch = time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)

// newStore returns a fake store on a manual clock.
func newStore(t *testing.T) (*fake.Store, *fake.Clock) {
	t.Helper()
	clock := fake.NewClock(epoch)
	return fake.New(fake.WithClock(clock.Now)), clock
}

// logs captures slog output as parsed JSON records.
type logs struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func newLogs() (*logs, *slog.Logger) {
	l := &logs{}
	return l, slog.New(slog.NewJSONHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func (l *logs) records(t *testing.T) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(l.buf.Bytes()))
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("log line %q: %v", sc.Text(), err)
		}
		out = append(out, m)
	}
	return out
}

// find returns the records at level whose message contains substr.
func (l *logs) find(t *testing.T, level, substr string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, r := range l.records(t) {
		if r["level"] == level && strings.Contains(r["msg"].(string), substr) {
			out = append(out, r)
		}
	}
	return out
}

// backendFunc adapts functions to store.Backend for fault tests of our own
// logic; the contract itself is proven against real backends.
type backendFunc struct {
	claim    func(ctx context.Context, key string, lease time.Duration) (store.Result, error)
	complete func(ctx context.Context, c store.Claim) (bool, error)
	release  func(ctx context.Context, c store.Claim) error
}

func (b backendFunc) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	return b.claim(ctx, key, lease)
}

func (b backendFunc) Complete(ctx context.Context, c store.Claim) (bool, error) {
	return b.complete(ctx, c)
}

func (b backendFunc) Release(ctx context.Context, c store.Claim) error { return b.release(ctx, c) }

// untouchable fails the test on any backend call.
func untouchable(t *testing.T) store.Backend {
	fail := func() { t.Errorf("the backend was called") }
	return backendFunc{
		claim: func(context.Context, string, time.Duration) (store.Result, error) {
			fail()
			return store.Result{}, nil
		},
		complete: func(context.Context, store.Claim) (bool, error) { fail(); return false, nil },
		release:  func(context.Context, store.Claim) error { fail(); return nil },
	}
}
