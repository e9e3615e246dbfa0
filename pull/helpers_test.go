package pull_test

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

// receive runs sub.Receive with cb until done, called after each
// callback returned with the message it got, reports true; it fails the
// test when that takes a minute.
func receive(t *testing.T, sub *pubsub.Subscriber, cb func(context.Context, *pubsub.Message), done func(m *pubsub.Message) bool) {
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

// logs is a JSON slog handler's output, read line by line.
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

// find returns the records of the level whose message holds msg.
func (l *logs) find(t *testing.T, level, msg string) []map[string]any {
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
