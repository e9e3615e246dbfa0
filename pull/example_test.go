package pull_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"sync/atomic"
	"time"

	"cloud.google.com/go/pubsub/v2"
	"cloud.google.com/go/pubsub/v2/apiv1/pubsubpb"
	"cloud.google.com/go/pubsub/v2/pstest"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/pull"
)

// A pull subscriber that ships each order once, though the order was
// published twice (two message ids): the key is the order id in the
// payload. It runs on pstest, the client library's in-process Pub/Sub,
// and fake.Store; in production the client is pubsub.NewClient(ctx,
// project) and the backend a shared store (redislock, sqllock,
// datastorelock, firestorelock, spannerlock).
func ExampleHandler() {
	ctx := context.Background()
	srv := pstest.NewServer()
	defer srv.Close()
	conn, err := grpc.NewClient(srv.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	client, err := pubsub.NewClient(ctx, "my-project", option.WithGRPCConn(conn))
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	const (
		topic = "projects/my-project/topics/orders"
		name  = "projects/my-project/subscriptions/orders-shipping"
	)
	if _, err := client.TopicAdminClient.CreateTopic(ctx, &pubsubpb.Topic{Name: topic}); err != nil {
		log.Fatal(err)
	}
	if _, err := client.SubscriptionAdminClient.CreateSubscription(ctx, &pubsubpb.Subscription{Name: name, Topic: topic}); err != nil {
		log.Fatal(err)
	}
	srv.Publish(topic, []byte(`{"order_id":"A-1"}`), nil)
	srv.Publish(topic, []byte(`{"order_id":"A-1"}`), nil) // the producer retried

	ship := func(ctx context.Context, m *pubsub.Message) error {
		var order struct {
			ID string `json:"order_id"`
		}
		if err := json.Unmarshal(m.Data, &order); err != nil {
			return err
		}
		fmt.Println("shipping order", order.ID)
		return nil
	}
	sub := client.Subscriber(name)
	sub.ReceiveSettings.MaxExtension = 10 * time.Minute // above the longest run of ship
	sub.ReceiveSettings.MaxOutstandingMessages = 1      // one at a time, for the example
	handler := pull.Handler(sub, fake.New(), ship,
		idempotency.WithKey(idempotency.JSONField("order_id")),
		idempotency.WithLeaseFromDeadline(30*time.Second)) // the lease ends with the client's extension

	// Stop once both messages are settled: a subscriber would run on.
	rctx, stop := context.WithCancel(ctx)
	var settled atomic.Int32
	err = sub.Receive(rctx, func(ctx context.Context, m *pubsub.Message) {
		handler(ctx, m)
		if settled.Add(1) == 2 {
			stop()
		}
	})
	if err != nil {
		log.Fatal(err)
	}
	// Output:
	// shipping order A-1
}
