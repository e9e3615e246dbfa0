package pull_test

import (
	"context"
	"testing"

	"cloud.google.com/go/pubsub/v2"
	"cloud.google.com/go/pubsub/v2/apiv1/pubsubpb"
	"cloud.google.com/go/pubsub/v2/pstest"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const (
	project = "pull-test"
	topic   = "projects/" + project + "/topics/orders"
	subName = "projects/" + project + "/subscriptions/orders-sub"
)

// fakePubSub is a pstest server with one topic and one subscription, and
// a client of it.
type fakePubSub struct {
	srv    *pstest.Server
	client *pubsub.Client
}

// newFakePubSub starts a pstest server (with the reactors given) holding
// topic and subName, the latter with exactly-once delivery when eod.
func newFakePubSub(t *testing.T, eod bool, reactors ...pstest.ServerReactorOption) *fakePubSub {
	t.Helper()
	srv := pstest.NewServer(reactors...)
	t.Cleanup(func() { _ = srv.Close() })
	conn, err := grpc.NewClient(srv.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	client, err := pubsub.NewClient(ctx, project, option.WithGRPCConn(conn))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Close() })
	if _, err := client.TopicAdminClient.CreateTopic(ctx, &pubsubpb.Topic{Name: topic}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.SubscriptionAdminClient.CreateSubscription(ctx, &pubsubpb.Subscription{
		Name: subName, Topic: topic, AckDeadlineSeconds: 10, EnableExactlyOnceDelivery: eod,
	}); err != nil {
		t.Fatal(err)
	}
	return &fakePubSub{srv: srv, client: client}
}

// message is the server's record of the message id.
func (f *fakePubSub) message(t *testing.T, id string) *pstest.Message {
	t.Helper()
	m := f.srv.Message(id)
	if m == nil {
		t.Fatalf("no message %s on the server", id)
	}
	return m
}
