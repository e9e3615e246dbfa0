package realtest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"errors"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"cloud.google.com/go/pubsub/v2"
	"cloud.google.com/go/pubsub/v2/apiv1/pubsubpb"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/pull"
	"github.com/gcp-pubsub-idempotency/idempotency/pull/internal/pulltest"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testsvc.StopAll()
	os.Exit(code)
}

// emulated is a topic and a subscription of their own on the Pub/Sub
// emulator, and a client of it.
type emulated struct {
	client *pubsub.Client
	topic  string
	sub    *pubsub.Subscriber
}

// newEmulated creates, on the emulator, a topic and a subscription in a
// project of the test's own.
func newEmulated(t *testing.T) *emulated {
	t.Helper()
	addr := testsvc.PubSub(t)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	project := "pull-" + strings.ToLower(rand.Text()[:12])
	client, err := pubsub.NewClient(ctx, project, option.WithGRPCConn(conn))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Close() })
	e := &emulated{client: client, topic: "projects/" + project + "/topics/orders"}
	subName := "projects/" + project + "/subscriptions/orders-sub"
	if _, err := client.TopicAdminClient.CreateTopic(ctx, &pubsubpb.Topic{Name: e.topic}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.SubscriptionAdminClient.CreateSubscription(ctx, &pubsubpb.Subscription{
		Name: subName, Topic: e.topic, AckDeadlineSeconds: 60,
	}); err != nil {
		t.Fatal(err)
	}
	e.sub = client.Subscriber(subName)
	return e
}

// publish publishes data with attrs and returns the message id.
func (e *emulated) publish(t *testing.T, data string, attrs map[string]string) string {
	t.Helper()
	p := e.client.Publisher(e.topic)
	defer p.Stop()
	id, err := p.Publish(context.Background(), &pubsub.Message{Data: []byte(data), Attributes: attrs}).Get(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// claims is a Redis backend that counts its claims.
type claims struct {
	*redislock.Backend
	n atomic.Int64
}

func (c *claims) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	c.n.Add(1)
	return c.Backend.Claim(ctx, key, lease)
}

// newRedis returns a backend on redis-server, under a prefix of its own.
func newRedis(t testing.TB) *claims {
	t.Helper()
	client := redis.NewClient(&redis.Options{Addr: testsvc.Redis(t)})
	t.Cleanup(func() { _ = client.Close() })
	b, err := redislock.New(client, redislock.WithPrefix("pull-"+rand.Text()[:8]+":"))
	if err != nil {
		t.Fatal(err)
	}
	return &claims{Backend: b}
}

// done reports whether the key is done in b.
func done(t *testing.T, b store.Operator, key string) bool {
	t.Helper()
	r, ok, err := b.Inspect(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	return ok && r.State == store.Done
}

// counting is a handler that counts its runs; fail gives the error of the
// n-th (from 1).
type counting struct {
	n    atomic.Int64
	fail func(n int64) error
}

func (c *counting) handle(context.Context, *pubsub.Message) error {
	n := c.n.Add(1)
	if c.fail != nil {
		return c.fail(n)
	}
	return nil
}

// One order published twice, under two message ids, keyed on its
// order_id attribute: on the emulator and Redis, the handler runs once
// and both deliveries are settled, the second as a duplicate.
func TestEmulatorAnOrderPublishedTwiceRunsOnce(t *testing.T) {
	e, b := newEmulated(t), newRedis(t)
	l, logger := pulltest.NewLogs()
	h := &counting{}
	e.publish(t, "order 42", map[string]string{"order_id": "42"})
	e.publish(t, "order 42", map[string]string{"order_id": "42"})
	var dups atomic.Int64
	// The two may come at once: the second then finds the key held, and
	// is nacked and redelivered until it finds it done.
	pulltest.Receive(t, e.sub, pull.Handler(e.sub, b, h.handle, idempotency.WithLogger(logger),
		idempotency.WithKey(idempotency.Attribute("order_id")), idempotency.WithKeyPrefix("orders:"),
		idempotency.OnDuplicate(func(context.Context, string) error { dups.Add(1); return nil })),
		func(*pubsub.Message) bool { return h.n.Load() >= 1 && dups.Load() >= 1 })
	if n := h.n.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
	if !done(t, b, "orders:42") {
		t.Error("the key orders:42 is not done")
	}
	if n := len(l.Find(t, "INFO", "duplicate delivery acknowledged")); n != 1 {
		t.Errorf("%d duplicate lines, want 1", n)
	}
}

// A handler's error nacks the message; the emulator redelivers it, the
// handler runs again, succeeds, and the key is done.
func TestEmulatorAFailedHandlerRunsAgainAfterItsNack(t *testing.T) {
	e, b := newEmulated(t), newRedis(t)
	l, logger := pulltest.NewLogs()
	h := &counting{fail: func(n int64) error {
		if n == 1 {
			return errors.New("the warehouse is down")
		}
		return nil
	}}
	id := e.publish(t, "x", nil)
	var c pulltest.Counter
	pulltest.Receive(t, e.sub, pull.Handler(e.sub, b, h.handle, idempotency.WithLogger(logger)),
		func(m *pubsub.Message) bool { n, _ := c.Add(m); return n == 2 })
	if n := h.n.Load(); n != 2 {
		t.Fatalf("the handler ran %d times, want 2", n)
	}
	if !done(t, b, id) {
		t.Error("the key is not done")
	}
	if n := len(l.Find(t, "ERROR", "pulled message failed; nacking")); n != 1 {
		t.Errorf("%d ERROR lines, want 1", n)
	}
}

// A key held by a live claim elsewhere: the emulator redelivers each nack
// at once, but every delivery waits at least half a second before its
// nack, so over a window of three seconds the key is claimed at most
// once per half second (a spinning nack would claim it hundreds of
// times), and no callback holds its slot for the holder's lease.
func TestEmulatorAHeldKeyDoesNotSpin(t *testing.T) {
	const window = 3 * time.Second
	e, b := newEmulated(t), newRedis(t)
	_, logger := pulltest.NewLogs()
	h := &counting{}
	id := e.publish(t, "x", nil)
	if r, err := b.Backend.Claim(context.Background(), id, time.Hour); err != nil || r.Outcome != store.Won {
		t.Fatalf("claiming the key elsewhere: %v %v", r.Outcome, err)
	}
	cb := pull.Handler(e.sub, b, h.handle, idempotency.WithLogger(logger))
	var (
		start     = time.Now()
		callbacks atomic.Int64
		mu        sync.Mutex
		elapsed   time.Duration
	)
	pulltest.Receive(t, e.sub, func(ctx context.Context, m *pubsub.Message) {
		cb(ctx, m)
		callbacks.Add(1)
	}, func(*pubsub.Message) bool {
		mu.Lock()
		defer mu.Unlock()
		elapsed = time.Since(start)
		return elapsed >= window
	})
	n, claimed := callbacks.Load(), b.n.Load()
	if h.n.Load() != 0 {
		t.Fatal("the handler ran")
	}
	if most := int64(elapsed/(500*time.Millisecond)) + 1; claimed > most {
		t.Errorf("%d claims in %v, want at most one per half second (%d)", claimed, elapsed, most)
	}
	if claimed != n {
		t.Errorf("%d claims for %d deliveries, want one each", claimed, n)
	}
	t.Logf("%d deliveries, %d claims in %v", n, claimed, elapsed)
}

// A message without the attribute that keys it is nacked with an ERROR
// line and redelivered; the handler never runs, nothing is claimed.
func TestEmulatorAnUnkeyedMessageIsNackedWithAnErrorLog(t *testing.T) {
	e, b := newEmulated(t), newRedis(t)
	l, logger := pulltest.NewLogs()
	h := &counting{}
	id := e.publish(t, "x", map[string]string{"other": "1"})
	var c pulltest.Counter
	pulltest.Receive(t, e.sub, pull.Handler(e.sub, b, h.handle, idempotency.WithLogger(logger), idempotency.WithKey(idempotency.Attribute("order_id"))),
		func(m *pubsub.Message) bool { n, _ := c.Add(m); return n == 2 })
	if h.n.Load() != 0 || b.n.Load() != 0 {
		t.Fatalf("the handler ran %d times, %d claims; want none", h.n.Load(), b.n.Load())
	}
	lines := l.Find(t, "ERROR", "dead-letter topic")
	if len(lines) < 2 || lines[0]["message_id"] != id || !strings.Contains(lines[0]["error"].(string), "no key") {
		t.Errorf("ERROR lines %v, want one per delivery naming the message and the missing key", lines)
	}
}

// With the disable switch set, both publishes of one order run the
// handler, and Redis is never called.
func TestEmulatorTheDisableSwitchRunsUnguarded(t *testing.T) {
	t.Setenv(idempotency.DisableEnv, "true")
	e, b := newEmulated(t), newRedis(t)
	_, logger := pulltest.NewLogs()
	h := &counting{}
	e.publish(t, "x", map[string]string{"order_id": "7"})
	e.publish(t, "x", map[string]string{"order_id": "7"})
	var c pulltest.Counter
	pulltest.Receive(t, e.sub, pull.Handler(e.sub, b, h.handle, idempotency.WithLogger(logger), idempotency.WithKey(idempotency.Attribute("order_id"))),
		func(m *pubsub.Message) bool { _, total := c.Add(m); return total == 2 })
	if n := h.n.Load(); n != 2 {
		t.Errorf("the handler ran %d times, want 2", n)
	}
	if b.n.Load() != 0 || done(t, b, "7") {
		t.Error("Redis was called")
	}
}

// HandlerTx on PostgreSQL: the handler's insert and the done mark commit
// together. A failing run rolls its insert back and leaves the key free;
// its redelivery inserts and completes; a second publish of the same
// order is a duplicate that inserts nothing.
func TestEmulatorHandlerTxOnPostgresCommitsTheWriteWithTheMark(t *testing.T) {
	e := newEmulated(t)
	db, err := sql.Open("pgx", testsvc.Postgres(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	suffix := strings.ToLower(rand.Text()[:8])
	keys, orders := "pull_keys_"+suffix, "pull_orders_"+suffix
	b, err := sqllock.New(db, sqllock.Postgres, sqllock.WithTable(keys))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := b.EnsureSchema(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, "CREATE TABLE "+orders+" (id TEXT NOT NULL, msg TEXT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	h := func(ctx context.Context, m *pubsub.Message, tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, "INSERT INTO "+orders+" (id, msg) VALUES ($1, $2)", m.Attributes["order_id"], m.ID); err != nil {
			return err
		}
		if runs.Add(1) == 1 {
			return errors.New("the run fails after its insert")
		}
		return nil
	}
	_, logger := pulltest.NewLogs()
	e.publish(t, "x", map[string]string{"order_id": "42"})
	e.publish(t, "x", map[string]string{"order_id": "42"})
	var dups atomic.Int64
	pulltest.Receive(t, e.sub, pull.HandlerTx(e.sub, b, h, idempotency.WithLogger(logger), idempotency.WithKey(idempotency.Attribute("order_id")),
		idempotency.OnDuplicate(func(context.Context, string) error { dups.Add(1); return nil })),
		func(*pubsub.Message) bool { return dups.Load() >= 1 })
	if !done(t, b, "42") {
		t.Error("the key is not done")
	}
	rows, err := db.QueryContext(ctx, "SELECT msg FROM "+orders)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var got []string
	for rows.Next() {
		var msg string
		if err := rows.Scan(&msg); err != nil {
			t.Fatal(err)
		}
		got = append(got, msg)
	}
	if len(got) != 1 {
		t.Fatalf("rows %v, want the one insert of the run that completed", got)
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("the handler ran %d times, want 2 (the failure, then the run that completed)", n)
	}
}
