package redislock_test

import (
	"context"
	"log"
	"os"

	"github.com/GoogleCloudPlatform/functions-framework-go/functions"
	cloudevents "github.com/cloudevents/sdk-go/v2"
	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// A Cloud Run function de-duplicating on Memorystore. Any
// redis.UniversalClient works: a single node, a cluster, or Sentinel.
func ExampleNew() {
	client := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{os.Getenv("REDIS_ADDR")}})
	backend, err := redislock.New(client, redislock.WithPrefix("orders-svc:"))
	if err != nil {
		log.Fatal(err)
	}
	functions.CloudEvent("HandleOrder", idempotency.Idempotent(backend)(
		func(ctx context.Context, e cloudevents.Event) error {
			return nil // send the order
		}))
}
