package pull_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"cloud.google.com/go/pubsub/v2"
	"github.com/cloudevents/sdk-go/v2/event"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/pull"
	"github.com/gcp-pubsub-idempotency/idempotency/pull/internal/pulltest"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A handler that panics does not take the subscriber down with it: the
// client runs each callback on a goroutine of its own, without a recover,
// so a panic there ends the process, leaving every other message in
// flight on it claimed until its lease lapses. As net/http does for a
// push, the callback recovers it: the message is nacked (an ERROR line
// says so), its claim is released, and its redelivery runs the handler
// again.
func TestAPanickingHandlerIsNackedAndItsRedeliveryRunsAgain(t *testing.T) {
	ps := newFakePubSub(t, false)
	s := fake.New()
	l, logger := pulltest.NewLogs()
	sub := ps.client.Subscriber(subName)
	id := ps.srv.Publish(topic, []byte("x"), nil)
	var runs atomic.Int32
	cb := pull.Handler(sub, s, func(context.Context, *pubsub.Message) error {
		if runs.Add(1) == 1 {
			panic("boom")
		}
		return nil
	}, idempotency.WithLogger(logger))
	var escaped atomic.Value
	var c pulltest.Counter
	pulltest.Receive(t, sub, func(ctx context.Context, m *pubsub.Message) {
		defer func() {
			if p := recover(); p != nil {
				escaped.Store(fmt.Sprint(p))
				m.Nack() // else Receive waits for it to the end of MaxExtension
			}
		}()
		cb(ctx, m)
	}, func(m *pubsub.Message) bool {
		n, _ := c.Add(m)
		return escaped.Load() != nil || n == 2
	})
	if p := escaped.Load(); p != nil {
		t.Fatalf("the handler's panic %q escaped the callback: it would end the subscriber's process", p)
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("the handler ran %d times, want 2 (the panic, then the redelivery)", n)
	}
	if ps.message(t, id).Acks != 1 {
		t.Error("the redelivery was not acked")
	}
	if r, _ := s.Record(id); r.State != store.Done {
		t.Errorf("the key is %v after the redelivery, want done", r.State)
	}
	if lines := l.Find(t, "ERROR", "pulled message failed"); len(lines) != 1 || !strings.Contains(fmt.Sprint(lines[0]["error"]), "panicked: boom") {
		t.Errorf("ERROR lines %v, want one naming the panic", lines)
	}
}

// With WithLeaseFromDeadline but no deadline to size the lease from (a
// negative MaxExtension: the client does not extend the message's ack
// deadline), the claim gets the fixed lease, which nothing renews: the
// lease must then end the handler's context, or the redelivery that the
// lapsed ack deadline brings takes the lapsed key and runs the handler a
// second time beside the first.
func TestWithLeaseFromDeadlineButNoExtensionTheLeaseEndsTheHandler(t *testing.T) {
	const lease = 2 * time.Minute
	sub := &pubsub.Subscriber{ReceiveSettings: pubsub.ReceiveSettings{MaxExtension: -1}}
	s := fake.New()
	var (
		deadline, expiry time.Time
		has              bool
	)
	pull.Handler(sub, s, func(ctx context.Context, m *pubsub.Message) error {
		deadline, has = ctx.Deadline()
		r, _ := s.Record(m.ID)
		expiry = r.LeaseExpiry
		return nil
	}, idempotency.WithLease(lease), idempotency.WithLeaseFromDeadline(time.Second))(context.Background(), &pubsub.Message{ID: "1"})
	if !has {
		t.Fatalf("the handler has no deadline, and its claim's lease (%v, not renewed) ends at %v", lease, expiry)
	}
	if deadline.After(expiry) {
		t.Errorf("the handler's deadline is %v after its claim's lease ends", deadline.Sub(expiry))
	}
}

// The CloudEvent the callback makes of a pulled message reads, through
// ParsePubSub, the keys and the fingerprints, as the push delivery of
// the same message does through PushHandler: a key or fingerprint of
// one path finds the other's.
func TestThePulledEventIsThePushedEventOfTheSameMessage(t *testing.T) {
	ps := newFakePubSub(t, false)
	sub := ps.client.Subscriber(subName)
	published := time.Date(2026, 12, 6, 2, 3, 4, 123456789, time.UTC)
	three := 3
	for _, m := range []*pubsub.Message{
		{ID: "1", Data: []byte(`{"order":{"id":"42"}}`), Attributes: map[string]string{"order_id": "42", "empty": ""}, PublishTime: published, OrderingKey: "ok", DeliveryAttempt: &three},
		{ID: "2", Data: nil, Attributes: map[string]string{"order_id": "7"}, PublishTime: published.Truncate(time.Millisecond)},
		{ID: "3", Data: []byte{0xff, 0xfe, 0, '"', '\\'}, PublishTime: published.Truncate(time.Second)},
		{ID: "4", Data: []byte(`{"order":{"id":"\u00e9"}}`)},
	} {
		t.Run(m.ID, func(t *testing.T) {
			pulled := capture(t, func(opts ...idempotency.Option) {
				pull.Handler(sub, fake.New(), func(context.Context, *pubsub.Message) error { return nil }, opts...)(context.Background(), m)
			})
			pushed := capture(t, func(opts ...idempotency.Option) {
				h := idempotency.PushHandler(fake.New(), func(context.Context, event.Event) error { return nil }, opts...)
				w := httptest.NewRecorder()
				h.ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(pushEnvelope(m, subName))))
				if w.Code != http.StatusNoContent {
					t.Fatalf("push: %d %s", w.Code, w.Body)
				}
			})
			if pulled.ID() != pushed.ID() || pulled.Type() != pushed.Type() || pulled.Source() != pushed.Source() || !pulled.Time().Equal(pushed.Time()) {
				t.Errorf("pulled event %s/%s/%s/%v, pushed %s/%s/%s/%v", pulled.ID(), pulled.Type(), pulled.Source(), pulled.Time(), pushed.ID(), pushed.Type(), pushed.Source(), pushed.Time())
			}
			pe, err1 := idempotency.ParsePubSub(pulled)
			qe, err2 := idempotency.ParsePubSub(pushed)
			if err1 != nil || err2 != nil {
				t.Fatalf("ParsePubSub: %v, %v", err1, err2)
			}
			if !bytes.Equal(pe.Message.Data, qe.Message.Data) || !pe.Message.PublishTime.Equal(qe.Message.PublishTime) ||
				fmt.Sprint(pe.Message.Attributes) != fmt.Sprint(qe.Message.Attributes) || pe.Message.ID != qe.Message.ID ||
				pe.Message.OrderingKey != qe.Message.OrderingKey || pe.Subscription != qe.Subscription || pe.DeliveryAttempt != qe.DeliveryAttempt {
				t.Errorf("pulled %+v\npushed %+v", pe, qe)
			}
			for name, f := range map[string]func(event.Event) (string, error){
				"PayloadFingerprint()":            idempotency.PayloadFingerprint(),
				"PayloadFingerprint(order_id)":    idempotency.PayloadFingerprint("order_id", "empty"),
				"JSONFieldsFingerprint(order.id)": idempotency.JSONFieldsFingerprint([]string{"order", "id"}),
				"JSONField(order, id)":            idempotency.JSONField("order", "id"),
				"Attribute(order_id)":             idempotency.Attribute("order_id"),
				"MessageID":                       idempotency.MessageID(),
				"EventID":                         idempotency.EventID(),
			} {
				a, errA := f(pulled)
				b, errB := f(pushed)
				if a != b || (errA == nil) != (errB == nil) {
					t.Errorf("%s: pulled %q (%v), pushed %q (%v)", name, a, errA, b, errB)
				}
			}
		})
	}
}

// capture returns the event the guarded function sees when deliver runs
// it with the options it is given.
func capture(t *testing.T, deliver func(...idempotency.Option)) event.Event {
	t.Helper()
	var got *event.Event
	deliver(idempotency.WithKey(func(e event.Event) (string, error) {
		e = e.Clone()
		got = &e
		return idempotency.MessageID()(e)
	}))
	if got == nil {
		t.Fatal("the key function never ran")
	}
	return *got
}

// pushEnvelope is the body of the push of m from the subscription sub,
// as Pub/Sub writes it: both spellings of the id and the publish time,
// data in base64 and absent when empty.
func pushEnvelope(m *pubsub.Message, sub string) []byte {
	msg := map[string]any{"messageId": m.ID, "message_id": m.ID}
	if len(m.Data) > 0 {
		msg["data"] = base64.StdEncoding.EncodeToString(m.Data)
	}
	if m.Attributes != nil {
		msg["attributes"] = m.Attributes
	}
	if !m.PublishTime.IsZero() {
		ts := m.PublishTime.UTC().Format(time.RFC3339Nano)
		msg["publishTime"], msg["publish_time"] = ts, ts
	}
	if m.OrderingKey != "" {
		msg["orderingKey"] = m.OrderingKey
	}
	env := map[string]any{"message": msg, "subscription": sub}
	if m.DeliveryAttempt != nil {
		env["deliveryAttempt"] = *m.DeliveryAttempt
	}
	b, _ := json.Marshal(env)
	return b
}

// A handler's error that carries a 503 status of its own (a cloudevents
// HTTP result, not ErrInProgress, which the guard logs) is nacked after
// the wait like a held key, with a WARN line that says so: otherwise the
// message comes back again and again and no line anywhere tells why.
func TestAHandlersOwn503IsNackedWithAWarnLine(t *testing.T) {
	pull.SetNackDelay(t, 0)
	l, logger := pulltest.NewLogs()
	pull.Handler(nil, fake.New(), func(context.Context, *pubsub.Message) error {
		return cehttp.NewResult(http.StatusServiceUnavailable, "downstream busy")
	}, idempotency.WithLogger(logger))(context.Background(), &pubsub.Message{ID: "1"})
	lines := append(l.Find(t, "WARN", ""), l.Find(t, "ERROR", "")...)
	if len(lines) != 1 || !strings.Contains(fmt.Sprint(lines[0]["error"]), "downstream busy") || lines[0]["message_id"] != "1" {
		t.Errorf("log lines %v, want one naming the message and the handler's error", lines)
	}
}

// HandlerTx recovers a panic of h as Handler does: the transaction is
// rolled back, nothing commits, the claim is released (a redelivery may
// claim the key at once), and the callback returns.
func TestAPanickingTxHandlerRollsBackAndReleasesTheKey(t *testing.T) {
	var commits, rollbacks atomic.Int32
	s := fake.New()
	b := fake.NewTx(s, func(context.Context) (int, error) { return 0, nil },
		func(int) error { commits.Add(1); return nil },
		func(int) error { rollbacks.Add(1); return nil })
	_, logger := pulltest.NewLogs()
	func() {
		defer func() {
			if p := recover(); p != nil {
				t.Fatalf("the panic %v escaped the callback", p)
			}
		}()
		pull.HandlerTx[int](nil, b, func(context.Context, *pubsub.Message, int) error { panic("boom") },
			idempotency.WithLogger(logger))(context.Background(), &pubsub.Message{ID: "1"})
	}()
	if commits.Load() != 0 || rollbacks.Load() != 1 {
		t.Errorf("%d commits, %d rollbacks; want none and one", commits.Load(), rollbacks.Load())
	}
	if res, err := s.Claim(context.Background(), "1", time.Minute); err != nil || res.Outcome != store.Won {
		t.Errorf("the key after the panic: %+v, %v; want it free to claim", res, err)
	}
}

// WithHeartbeat renews nothing on a backend that is not a
// store.Extender (the guard says so at WARN and runs on the fixed
// lease): a wrapper that exposes only store.Backend is one. The lease,
// which nothing renews, must then still end the handler's context, as
// without the option.
func TestAHeartbeatTheBackendCannotRenewLeavesTheLeaseBound(t *testing.T) {
	const lease = 2 * time.Minute
	s := fake.New()
	b := struct{ store.Backend }{s} // no Extend
	var (
		deadline, expiry time.Time
		has              bool
	)
	_, logger := pulltest.NewLogs()
	pull.Handler(nil, b, func(ctx context.Context, m *pubsub.Message) error {
		deadline, has = ctx.Deadline()
		r, _ := s.Record(m.ID)
		expiry = r.LeaseExpiry
		return nil
	}, idempotency.WithLease(lease), idempotency.WithHeartbeat(time.Second), idempotency.WithLogger(logger))(context.Background(), &pubsub.Message{ID: "1"})
	if !has || deadline.After(expiry) {
		t.Errorf("the handler's deadline is %v (%v) after its claim's lease (%v, not renewed) ends", deadline.Sub(expiry), has, lease)
	}
}
