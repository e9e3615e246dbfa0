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
	"github.com/gcp-pubsub-idempotency/idempotency/function_example/orders"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testsvc.StopAll() // the shared Redis and PostgreSQL, and their directories
	os.Exit(code)
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
				b, _, err := orders.Setup(t.Context())
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
		if _, _, err := orders.Setup(t.Context()); err == nil {
			t.Fatal("a Redis that does not answer was accepted at start-up")
		}
	})
}

// clearBackendEnv unsets every variable that chooses the backend.
func clearBackendEnv(t *testing.T) {
	for _, k := range []string{"IDEMPOTENCY_BACKEND", "REDIS_ADDR", "POSTGRES_DSN", "GOOGLE_CLOUD_PROJECT",
		"DATASTORE_PROJECT_ID", "K_SERVICE", orders.AllowMemoryOnCloudRun, "IDEMPOTENCY_LEASE"} {
		t.Setenv(k, "")
	}
}
