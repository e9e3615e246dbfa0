package orders_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"reflect"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/function_example/orders"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testsvc.StopAll() // the shared Redis and PostgreSQL, and their directories
	os.Exit(code)
}

func TestSetupReadsTheLeaseAndFallsBackToMemory(t *testing.T) {
	clearBackendEnv(t)
	for v, want := range map[string]time.Duration{"": store.DefaultLease, "90s": 90 * time.Second} {
		t.Setenv("IDEMPOTENCY_LEASE", v)
		b, lease, err := orders.Setup(t.Context())
		if err != nil || lease != want {
			t.Fatalf("IDEMPOTENCY_LEASE=%q: lease %v, %v; want %v", v, lease, err, want)
		}
		if _, ok := b.(*fake.Store); !ok {
			t.Fatalf("backend %T without a project, want the in-memory store", b)
		}
	}
	for _, bad := range []string{"soon", "-1s", "0"} {
		t.Setenv("IDEMPOTENCY_LEASE", bad)
		if _, _, err := orders.Setup(t.Context()); err == nil {
			t.Errorf("IDEMPOTENCY_LEASE=%q accepted", bad)
		}
	}
}

// clearBackendEnv unsets every variable that chooses the backend.
func clearBackendEnv(t *testing.T) {
	for _, k := range []string{"IDEMPOTENCY_BACKEND", "REDIS_ADDR", "POSTGRES_DSN", "GOOGLE_CLOUD_PROJECT", "DATASTORE_PROJECT_ID"} {
		t.Setenv(k, "")
	}
}

func TestBackendKindFollowsTheEnvironment(t *testing.T) {
	cases := []struct {
		env  map[string]string
		want string // "" when BackendKind must fail
	}{
		{map[string]string{}, "memory"},
		{map[string]string{"GOOGLE_CLOUD_PROJECT": "p"}, "datastore"},
		{map[string]string{"DATASTORE_PROJECT_ID": "p"}, "datastore"},
		{map[string]string{"REDIS_ADDR": "127.0.0.1:6379", "GOOGLE_CLOUD_PROJECT": "p"}, "redis"},
		{map[string]string{"POSTGRES_DSN": "postgres://x", "GOOGLE_CLOUD_PROJECT": "p"}, "postgres"},
		{map[string]string{"REDIS_ADDR": "127.0.0.1:6379", "POSTGRES_DSN": "postgres://x"}, ""},
		{map[string]string{"REDIS_ADDR": "127.0.0.1:6379", "POSTGRES_DSN": "postgres://x", "IDEMPOTENCY_BACKEND": "postgres"}, "postgres"},
		{map[string]string{"REDIS_ADDR": "127.0.0.1:6379", "GOOGLE_CLOUD_PROJECT": "p", "IDEMPOTENCY_BACKEND": "datastore"}, "datastore"},
		{map[string]string{"REDIS_ADDR": "127.0.0.1:6379", "IDEMPOTENCY_BACKEND": "memory"}, "memory"},
		{map[string]string{"IDEMPOTENCY_BACKEND": "redis"}, ""},
		{map[string]string{"IDEMPOTENCY_BACKEND": "postgres"}, ""},
		{map[string]string{"IDEMPOTENCY_BACKEND": "datastore"}, ""},
		{map[string]string{"IDEMPOTENCY_BACKEND": "mysql", "POSTGRES_DSN": "postgres://x"}, ""},
	}
	for _, c := range cases {
		clearBackendEnv(t)
		for k, v := range c.env {
			t.Setenv(k, v)
		}
		got, err := orders.BackendKind()
		switch {
		case c.want == "" && err == nil:
			t.Errorf("%v: chose %q, want an error", c.env, got)
		case c.want != "" && (err != nil || got != c.want):
			t.Errorf("%v: %q, %v; want %q", c.env, got, err, c.want)
		}
	}
}

// The backends the environment chooses are real: two runs of one key
// against the same server (as two instances would) run the body once.
func TestBackendRedisAndPostgresFromTheEnvironment(t *testing.T) {
	for _, c := range []struct {
		name string
		env  func(t *testing.T) (string, string)
		want any
	}{
		{"redis", func(t *testing.T) (string, string) { return "REDIS_ADDR", testsvc.Redis(t) }, (*redislock.Backend)(nil)},
		{"postgres", func(t *testing.T) (string, string) { return "POSTGRES_DSN", testsvc.Postgres(t) }, (*sqllock.Backend)(nil)},
	} {
		t.Run(c.name, func(t *testing.T) {
			clearBackendEnv(t)
			k, v := c.env(t)
			t.Setenv(k, v)
			key := fmt.Sprintf("orders-test:%s:%d", c.name, time.Now().UnixNano())
			runs := 0
			for i := range 2 {
				b, err := orders.Backend(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				if reflect.TypeOf(b) != reflect.TypeOf(c.want) {
					t.Fatalf("%s=%s: backend %T, want %T", k, v, b, c.want)
				}
				err = idempotency.Lock(t.Context(), b, key, func(context.Context) error { runs++; return nil })
				if want := i == 1; errors.Is(err, idempotency.ErrDuplicate) != want || (!want && err != nil) {
					t.Fatalf("run %d: %v", i+1, err)
				}
			}
			if runs != 1 {
				t.Fatalf("the body ran %d times, want 1", runs)
			}
		})
	}
	t.Run("unreachable", func(t *testing.T) {
		clearBackendEnv(t)
		port, err := testsvc.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		t.Setenv("REDIS_ADDR", fmt.Sprintf("127.0.0.1:%d", port))
		if _, err := orders.Backend(t.Context()); err == nil {
			t.Fatal("a Redis that does not answer was accepted at start-up")
		}
	})
}
