package pull_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"cloud.google.com/go/pubsub/v2"
	"cloud.google.com/go/pubsub/v2/pstest"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/pull"
	"github.com/gcp-pubsub-idempotency/idempotency/pull/internal/pulltest"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// runs counts a handler's runs and keeps the messages it saw.
type runs struct {
	mu   sync.Mutex
	seen []*pubsub.Message
	fail func(n int) error // the error of the n-th run (from 1); nil: none
}

func (r *runs) handle(_ context.Context, m *pubsub.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seen = append(r.seen, m)
	if r.fail != nil {
		return r.fail(len(r.seen))
	}
	return nil
}

func (r *runs) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.seen)
}

// Two publishes of one order, under two message ids, keyed on the order id
// in the payload: the handler runs once, with one of them as published,
// and both are acked (the other as a duplicate).
func TestOneBusinessKeyUnderTwoMessageIDsRunsOnce(t *testing.T) {
	ps := newFakePubSub(t, false)
	s := fake.New()
	h := &runs{}
	sub := ps.client.Subscriber(subName)
	sub.ReceiveSettings.MaxOutstandingMessages = 1 // one after the other
	data := []byte(`{"order":{"id":"42"}}`)
	id1 := ps.srv.Publish(topic, data, map[string]string{"source": "a"})
	id2 := ps.srv.Publish(topic, data, map[string]string{"source": "a"})
	var c pulltest.Counter
	pulltest.Receive(t, sub, pull.Handler(sub, s, h.handle, idempotency.WithKey(idempotency.JSONField("order", "id"))),
		func(m *pubsub.Message) bool { _, total := c.Add(m); return total == 2 })
	if n := h.count(); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
	if got := h.seen[0]; (got.ID != id1 && got.ID != id2) || string(got.Data) != string(data) || got.Attributes["source"] != "a" {
		t.Errorf("the handler got message %s %q %v, want one of %s and %s as published", got.ID, got.Data, got.Attributes, id1, id2)
	}
	for _, id := range []string{id1, id2} {
		if m := ps.message(t, id); m.Acks != 1 || m.Deliveries != 1 {
			t.Errorf("message %s: %d acks, %d deliveries; want 1 and 1", id, m.Acks, m.Deliveries)
		}
	}
	if r, ok := s.Record("42"); !ok || r.State != store.Done {
		t.Errorf("the key 42 is %+v (found %v), want done", r, ok)
	}
}

// A handler's error nacks the message (ERROR) and releases its key; the
// redelivery runs the handler again and, when it succeeds, is acked.
func TestAFailedHandlerIsNackedAndItsRedeliveryRunsAgain(t *testing.T) {
	ps := newFakePubSub(t, false)
	l, logger := pulltest.NewLogs()
	h := &runs{fail: func(n int) error {
		if n == 1 {
			return errors.New("the warehouse is down")
		}
		return nil
	}}
	sub := ps.client.Subscriber(subName)
	id := ps.srv.Publish(topic, []byte("x"), nil)
	pulltest.Receive(t, sub, pull.Handler(sub, fake.New(), h.handle, idempotency.WithLogger(logger)),
		func(*pubsub.Message) bool { return h.count() == 2 })
	if m := ps.message(t, id); m.Acks != 1 || m.Deliveries != 2 {
		t.Errorf("%d acks, %d deliveries; want 1 and 2", m.Acks, m.Deliveries)
	}
	lines := l.Find(t, "ERROR", "pulled message failed; nacking")
	if len(lines) != 1 || lines[0]["message_id"] != id || !strings.Contains(lines[0]["error"].(string), "the warehouse is down") ||
		lines[0]["subscription"] != subName {
		t.Errorf("ERROR lines %v, want one naming the message, the subscription and the error", lines)
	}
}

// A message without a key, and one whose payload the key cannot be read
// from, are nacked with an ERROR line that says where they end up; the
// handler never runs, and nothing is claimed.
func TestMessagesAtFaultAreNackedWithAnErrorLog(t *testing.T) {
	ps := newFakePubSub(t, false)
	l, logger := pulltest.NewLogs()
	s := fake.New()
	h := &runs{}
	sub := ps.client.Subscriber(subName)
	unkeyed := ps.srv.Publish(topic, []byte(`{"order":{}}`), nil)
	malformed := ps.srv.Publish(topic, []byte(`not json`), nil)
	var c pulltest.Counter
	pulltest.Receive(t, sub, pull.Handler(sub, s, h.handle, idempotency.WithLogger(logger), idempotency.WithKey(idempotency.JSONField("order", "id"))),
		func(m *pubsub.Message) bool {
			_, total := c.Add(m)
			return c.Of(unkeyed) >= 2 && c.Of(malformed) >= 2 && total >= 4
		})
	if n := h.count(); n != 0 {
		t.Fatalf("the handler ran %d times", n)
	}
	if n := s.Calls(fake.OpClaim); n != 0 {
		t.Errorf("%d claims, want none", n)
	}
	for _, id := range []string{unkeyed, malformed} {
		if m := ps.message(t, id); m.Acks != 0 {
			t.Errorf("message %s was acked", id)
		}
		var found bool
		for _, r := range l.Find(t, "ERROR", "dead-letter topic") {
			found = found || (r["message_id"] == id && r["status"] == float64(400))
		}
		if !found {
			t.Errorf("no ERROR line with status 400 for message %s", id)
		}
	}
}

// A key held by a live claim elsewhere: each delivery claims once, finds
// it held, waits at least half the nack delay, and nacks; the callback
// holds no slot for the holder's lease (an hour).
func TestAHeldKeyIsNackedAfterABoundedWait(t *testing.T) {
	const delay = 200 * time.Millisecond
	pull.SetNackDelay(t, delay)
	ps := newFakePubSub(t, false)
	l, logger := pulltest.NewLogs()
	s := fake.New()
	h := &runs{}
	sub := ps.client.Subscriber(subName)
	id := ps.srv.Publish(topic, []byte("x"), nil)
	if r, err := s.Claim(context.Background(), id, time.Hour); err != nil || r.Outcome != store.Won {
		t.Fatalf("claiming the key elsewhere: %v %v", r.Outcome, err)
	}
	cb := pull.Handler(sub, s, h.handle, idempotency.WithLogger(logger))
	var (
		c       pulltest.Counter
		mu      sync.Mutex
		shortes = time.Hour
		calls   int // callbacks that returned, all of them (Receive waits for them)
	)
	pulltest.Receive(t, sub, func(ctx context.Context, m *pubsub.Message) {
		start := time.Now()
		cb(ctx, m)
		mu.Lock()
		shortes = min(shortes, time.Since(start))
		calls++
		mu.Unlock()
	}, func(m *pubsub.Message) bool { n, _ := c.Add(m); return n == 3 })
	if n := h.count(); n != 0 {
		t.Fatalf("the handler ran %d times", n)
	}
	if n := s.Calls(fake.OpClaim); n != calls+1 {
		t.Errorf("%d claims for %d deliveries and ours, want one each", n, calls)
	}
	if shortes < delay/2 {
		t.Errorf("a callback returned after %v, before half the nack delay (%v)", shortes, delay/2)
	}
	if m := ps.message(t, id); m.Acks != 0 {
		t.Error("the message was acked")
	}
	if n := len(l.Find(t, "WARN", "in progress elsewhere")); n < 3 {
		t.Errorf("%d WARN lines, want one per delivery", n)
	}
}

// The wait before a 503's nack ends with the callback's context: a
// subscriber that shuts down is not held up by it.
func TestTheNackWaitEndsWithTheContext(t *testing.T) {
	pull.SetNackDelay(t, time.Hour)
	s := fake.New()
	m := &pubsub.Message{ID: "1", Data: []byte("x")}
	if _, err := s.Claim(context.Background(), m.ID, time.Hour); err != nil {
		t.Fatal(err)
	}
	_, logger := pulltest.NewLogs()
	cb := pull.Handler(nil, s, (&runs{}).handle, idempotency.WithLogger(logger))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { cb(ctx, m); close(done) }()
	for s.Calls(fake.OpClaim) < 2 { // the callback's claim was refused: it waits
		time.Sleep(time.Millisecond)
	}
	cancel()
	<-done // returns, rather than after an hour
}

// On a subscription with exactly-once delivery, an ack that fails after
// the work is done is logged at WARN; the redelivery finds the key done
// and is acked as a duplicate without running the handler.
func TestAFailedAckOnExactlyOnceDeliveryIsAckedAsADuplicateLater(t *testing.T) {
	var acks atomic.Int32
	failFirstAck := pstest.ServerReactorOption{FuncName: "Acknowledge", Reactor: reactor(func(any) (bool, any, error) {
		if acks.Add(1) == 1 {
			return false, nil, status.Error(codes.PermissionDenied, "injected: ack refused")
		}
		return false, nil, nil
	})}
	ps := newFakePubSub(t, true, failFirstAck)
	var skew atomic.Int64 // the server's clock runs ahead by skew
	ps.srv.SetTimeNowFunc(func() time.Time { return time.Now().Add(time.Duration(skew.Load())) })
	l, logger := pulltest.NewLogs()
	s := fake.New()
	h := &runs{}
	sub := ps.client.Subscriber(subName)
	id := ps.srv.Publish(topic, []byte("x"), nil)
	var c pulltest.Counter
	pulltest.Receive(t, sub, pull.Handler(sub, s, h.handle, idempotency.WithLogger(logger)), func(m *pubsub.Message) bool {
		n, _ := c.Add(m)
		if n == 1 {
			// The ack failed: let its ack deadline (the client's modack of
			// 60 s) pass on the server, within pstest's 10 minutes'
			// retention of a message.
			skew.Store(int64(2 * time.Minute))
		}
		return n == 2
	})
	if n := h.count(); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
	if m := ps.message(t, id); m.Acks != 1 || m.Deliveries != 2 {
		t.Errorf("%d acks, %d deliveries; want the redelivery's ack (1) and 2", m.Acks, m.Deliveries)
	}
	warn := l.Find(t, "WARN", "the ack of a pulled message failed")
	if len(warn) != 1 || warn[0]["message_id"] != id || !strings.Contains(warn[0]["error"].(string), "injected") {
		t.Errorf("WARN lines %v, want one for the failed ack", warn)
	}
	if n := len(l.Find(t, "INFO", "duplicate delivery acknowledged")); n != 1 {
		t.Errorf("%d duplicate lines, want 1", n)
	}
}

type reactor func(any) (bool, any, error)

func (r reactor) React(req any) (bool, any, error) { return r(req) }

// With the disable switch set, the handler runs for every message, and
// the backend is never called.
func TestTheDisableSwitchRunsUnguarded(t *testing.T) {
	t.Setenv(idempotency.DisableEnv, "1")
	ps := newFakePubSub(t, false)
	_, logger := pulltest.NewLogs()
	s := fake.New()
	h := &runs{}
	sub := ps.client.Subscriber(subName)
	id1 := ps.srv.Publish(topic, []byte(`{"id":1}`), nil)
	id2 := ps.srv.Publish(topic, []byte(`{"id":1}`), nil)
	var c pulltest.Counter
	pulltest.Receive(t, sub, pull.Handler(sub, s, h.handle, idempotency.WithLogger(logger), idempotency.WithKey(idempotency.JSONField("id"))),
		func(m *pubsub.Message) bool { _, total := c.Add(m); return total == 2 })
	if n := h.count(); n != 2 {
		t.Errorf("the handler ran %d times, want 2", n)
	}
	if s.Len() != 0 || s.Calls(fake.OpClaim) != 0 {
		t.Error("the backend was called")
	}
	for _, id := range []string{id1, id2} {
		if ps.message(t, id).Acks != 1 {
			t.Errorf("message %s was not acked", id)
		}
	}
}

// The handler's context ends MaxExtension after the callback started;
// with WithLeaseFromDeadline, the claim's lease ends then, plus the
// settle timeout and the margin.
func TestTheHandlerEndsWithTheAckDeadlineExtension(t *testing.T) {
	const (
		ext    = 90 * time.Second
		margin = 5 * time.Second
	)
	ps := newFakePubSub(t, false)
	s := fake.New()
	sub := ps.client.Subscriber(subName)
	sub.ReceiveSettings.MaxExtension = ext
	id := ps.srv.Publish(topic, []byte("x"), nil)
	var (
		start    time.Time
		deadline time.Time
		lease    time.Time
	)
	cb := pull.Handler(sub, s, func(ctx context.Context, m *pubsub.Message) error {
		deadline, _ = ctx.Deadline()
		r, _ := s.Record(m.ID)
		lease = r.LeaseExpiry
		return nil
	}, idempotency.WithLeaseFromDeadline(margin))
	pulltest.Receive(t, sub, func(ctx context.Context, m *pubsub.Message) {
		start = time.Now()
		cb(ctx, m)
	}, func(*pubsub.Message) bool { return true })
	if ps.message(t, id).Acks != 1 {
		t.Fatal("not acked")
	}
	if deadline.Before(start.Add(ext)) || deadline.After(time.Now().Add(ext)) {
		t.Errorf("the handler's deadline is %v after the callback's start, want MaxExtension (%v)", deadline.Sub(start), ext)
	}
	if want := deadline.Add(idempotency.DefaultSettleTimeout + margin); lease.Before(want.Add(-time.Second)) || lease.After(want.Add(time.Second)) {
		t.Errorf("the lease ends %v after the handler's deadline, want the settle timeout and the margin (%v)", lease.Sub(deadline), idempotency.DefaultSettleTimeout+margin)
	}
}

// Without a subscriber, the client's default MaxExtension bounds the
// handler; with a negative one (no extension), nothing does.
func TestTheHandlersDeadlineFollowsTheClientsSettings(t *testing.T) {
	renewed := []idempotency.Option{idempotency.WithHeartbeat(time.Minute)}
	long := []idempotency.Option{idempotency.WithLease(2 * time.Hour)}
	for _, c := range []struct {
		name string
		sub  *pubsub.Subscriber
		opts []idempotency.Option
		want time.Duration // 0: no deadline
	}{
		{"nil subscriber, heartbeat", nil, renewed, pubsub.DefaultReceiveSettings.MaxExtension},
		{"zero MaxExtension, heartbeat", &pubsub.Subscriber{}, renewed, pubsub.DefaultReceiveSettings.MaxExtension},
		{"negative MaxExtension, heartbeat", &pubsub.Subscriber{ReceiveSettings: pubsub.ReceiveSettings{MaxExtension: -1}}, renewed, 0},
		{"nil subscriber, lease above it", nil, long, pubsub.DefaultReceiveSettings.MaxExtension},
		// Nothing renews the claim: the lease, shorter, ends h first.
		{"defaults", nil, nil, store.DefaultLease},
		{"negative MaxExtension, default lease", &pubsub.Subscriber{ReceiveSettings: pubsub.ReceiveSettings{MaxExtension: -1}}, nil, store.DefaultLease},
		{"MaxExtension below the lease", &pubsub.Subscriber{ReceiveSettings: pubsub.ReceiveSettings{MaxExtension: time.Minute}}, nil, time.Minute},
	} {
		t.Run(c.name, func(t *testing.T) {
			var (
				deadline time.Time
				has      bool
			)
			start := time.Now()
			var logs bytes.Buffer
			opts := append([]idempotency.Option{idempotency.WithLogger(slog.New(slog.NewTextHandler(&logs, nil)))}, c.opts...)
			pull.Handler(c.sub, fake.New(), func(ctx context.Context, _ *pubsub.Message) error {
				deadline, has = ctx.Deadline()
				return nil
			}, opts...)(context.Background(), &pubsub.Message{ID: "1"})
			if strings.Contains(logs.String(), "outlive its lease") {
				t.Errorf("the delivery warned that it may outlive its lease: %s", logs.String())
			}
			switch {
			case c.want == 0 && has:
				t.Errorf("a deadline %v after the start", deadline.Sub(start))
			case c.want != 0 && (!has || deadline.Before(start.Add(c.want)) || deadline.After(time.Now().Add(c.want))):
				t.Errorf("deadline %v (%v) after the start, want %v", deadline.Sub(start), has, c.want)
			}
		})
	}
}

// Handler and HandlerTx refuse a nil handler when they are called.
func TestANilHandlerPanics(t *testing.T) {
	for name, f := range map[string]func(){
		"Handler": func() { pull.Handler(nil, fake.New(), nil) },
		"HandlerTx": func() {
			none := func(int) error { return nil }
			begin := func(context.Context) (int, error) { return 0, nil }
			pull.HandlerTx[int](nil, fake.NewTx(fake.New(), begin, none, none), nil)
		},
	} {
		func() {
			defer func() {
				if p := recover(); p == nil || !strings.Contains(p.(string), "nil handler") {
					t.Errorf("%s: panic %v, want one about the nil handler", name, p)
				}
			}()
			f()
		}()
	}
}

// A message whose key was done by another payload is nacked, with the
// guard's one ERROR line carrying both fingerprints and no second line
// of the callback's own; it never runs.
func TestAPayloadMismatchIsNackedWithOneErrorLine(t *testing.T) {
	ps := newFakePubSub(t, false)
	l, logger := pulltest.NewLogs()
	h := &runs{}
	sub := ps.client.Subscriber(subName)
	sub.ReceiveSettings.MaxOutstandingMessages = 1 // the second waits for the first to finish
	ids := []string{
		ps.srv.Publish(topic, []byte("one payload"), map[string]string{"order_id": "9"}),
		ps.srv.Publish(topic, []byte("another payload"), map[string]string{"order_id": "9"}),
	}
	var c pulltest.Counter
	pulltest.Receive(t, sub, pull.Handler(sub, fake.New(), h.handle, idempotency.WithLogger(logger), idempotency.WithKey(idempotency.Attribute("order_id"))),
		func(m *pubsub.Message) bool { n, _ := c.Add(m); return n == 2 })
	if n := h.count(); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
	ran := h.seen[0].ID
	for _, id := range ids {
		if acks := ps.message(t, id).Acks; (id == ran) != (acks == 1) {
			t.Errorf("message %s: %d acks; want 1 for the one that ran, 0 for the other", id, acks)
		}
	}
	mismatches := l.Find(t, "ERROR", "different payload")
	if len(mismatches) < 2 || mismatches[0]["stored_fingerprint"] == nil || mismatches[0]["delivered_fingerprint"] == nil {
		t.Errorf("ERROR lines %v, want one with both fingerprints per delivery of the other payload", mismatches)
	}
	if n := len(l.Find(t, "ERROR", "pulled message")); n != 0 {
		t.Errorf("%d ERROR lines of the callback's own, want none", n)
	}
}
