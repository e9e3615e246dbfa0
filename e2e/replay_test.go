package e2e

// Replay after a fix (docs/operations.md, "Replaying messages after a
// fix"): a handler with a bug ran and acked; the team fixes it and seeks
// the subscription back, Google's documented way to replay. These tests
// run that on the Pub/Sub emulator, with a push subscription into a
// PushHandler in this process (so that the test can act on its store),
// and show what each procedure of the docs does.
//
// What the emulator does (pubsub-emulator 0.8.20, observed by these tests
// and by hand over its REST API): it implements Seek, to a time and to a
// snapshot, and CreateSnapshot. A subscription with retainAckedMessages
// and a seek to a time before the messages' publishTime pushes every
// acked message again; without retainAckedMessages the same seek
// delivers nothing (acked messages are gone, as on Google Cloud). A
// snapshot taken before the messages were published brings them all back
// whatever the retention. A message delivered again after a seek keeps
// its messageId, so the default MessageID key suppresses a seek replay
// exactly as a business key does; a republished message gets a new
// messageId, which only a business key recognises.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
)

// replayRun is one run of the handler's body.
type replayRun struct {
	key     string // the key it held, as stored (prefix included)
	po      string // the order it processed (the po_id attribute)
	version int    // the handler's version: 1 had the bug, 2 is the fix
}

// replayDelivery is one push the consumer answered.
type replayDelivery struct {
	messageID string
	po        string
	published time.Time
	status    int
}

// replayConsumer is a push endpoint in this process: PushHandler over a
// backend, which a "deploy" replaces (another handler version, another
// key prefix), recording each delivery, each run of the body and each
// duplicate the guard suppressed.
type replayConsumer struct {
	srv *httptest.Server

	mu         sync.Mutex
	handler    http.Handler
	version    int
	deliveries []replayDelivery
	runs       []replayRun
	dups       []string // keys OnDuplicate was called with
}

func newReplayConsumer(t *testing.T) *replayConsumer {
	c := &replayConsumer{}
	c.srv = httptest.NewServer(http.HandlerFunc(c.serve))
	t.Cleanup(c.srv.Close)
	return c
}

// deploy serves version of the handler over b with opts from now on.
func (c *replayConsumer) deploy(version int, b store.Backend, opts ...idempotency.Option) {
	body := func(ctx context.Context, e event.Event) error {
		claim, _ := idempotency.ClaimFrom(ctx)
		ev, err := idempotency.ParsePubSub(e)
		if err != nil {
			return err
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		c.runs = append(c.runs, replayRun{key: claim.Key, po: ev.Message.Attributes["po_id"], version: c.version})
		return nil
	}
	opts = append(slices.Clone(opts), idempotency.OnDuplicate(func(_ context.Context, key string) error {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.dups = append(c.dups, key)
		return nil
	}))
	h := idempotency.PushHandler(b, body, opts...)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.handler, c.version = h, version
}

func (c *replayConsumer) serve(w http.ResponseWriter, r *http.Request) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var env struct {
		Message struct {
			MessageID   string            `json:"messageId"`
			Attributes  map[string]string `json:"attributes"`
			PublishTime time.Time         `json:"publishTime"`
		} `json:"message"`
	}
	_ = json.Unmarshal(b, &env)
	r.Body = io.NopCloser(bytes.NewReader(b))
	c.mu.Lock()
	h := c.handler
	c.mu.Unlock()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, r)
	c.mu.Lock()
	c.deliveries = append(c.deliveries, replayDelivery{
		messageID: env.Message.MessageID, po: env.Message.Attributes["po_id"],
		published: env.Message.PublishTime, status: rec.Code,
	})
	c.mu.Unlock()
	for k, v := range rec.Header() {
		w.Header()[k] = v
	}
	w.WriteHeader(rec.Code)
	w.Write(rec.Body.Bytes())
}

// phase is what the consumer saw since a mark.
type phase struct {
	deliveries []replayDelivery
	runs       []replayRun
	dups       []string
}

// idOf returns the messageId with which po was delivered in the phase.
func (p phase) idOf(po string) string {
	for _, d := range p.deliveries {
		if d.po == po {
			return d.messageID
		}
	}
	return ""
}

type replayMark struct{ deliveries, runs, dups int }

func (c *replayConsumer) mark() replayMark {
	c.mu.Lock()
	defer c.mu.Unlock()
	return replayMark{len(c.deliveries), len(c.runs), len(c.dups)}
}

// settle waits until at least n deliveries arrived since m and then none
// for two seconds, and returns what arrived since m.
func (c *replayConsumer) settle(t *testing.T, m replayMark, n int) phase {
	t.Helper()
	count := func() int {
		c.mu.Lock()
		defer c.mu.Unlock()
		return len(c.deliveries) - m.deliveries
	}
	eventually(t, 60*time.Second, fmt.Sprintf("%d deliveries", n), func() bool { return count() >= n })
	last, since := count(), time.Now()
	for time.Since(since) < 2*time.Second {
		time.Sleep(100 * time.Millisecond)
		if k := count(); k != last {
			last, since = k, time.Now()
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return phase{
		deliveries: slices.Clone(c.deliveries[m.deliveries:]),
		runs:       slices.Clone(c.runs[m.runs:]),
		dups:       slices.Clone(c.dups[m.dups:]),
	}
}

// replaySub is a topic with one push subscription to a consumer. With
// retainAcked the subscription keeps acked messages (for the shortest
// retention Pub/Sub accepts), so that a seek to a time can replay them.
type replaySub struct {
	ps    *pubsub
	topic string
	sub   string
}

func newReplaySub(t *testing.T, name string, c *replayConsumer, retainAcked bool) *replaySub {
	ps := newPubSub(t, name)
	s := &replaySub{ps: ps, topic: "orders", sub: "orders-replay"}
	ps.topic(t, s.topic)
	sub := map[string]any{
		"topic":              "projects/" + ps.project + "/topics/" + s.topic,
		"pushConfig":         map[string]any{"pushEndpoint": c.srv.URL + "/orders"},
		"ackDeadlineSeconds": 10,
	}
	if retainAcked {
		sub["retainAckedMessages"] = true
		sub["messageRetentionDuration"] = "600s"
	}
	ps.do(t, http.MethodPut, "/subscriptions/"+s.sub, sub, nil)
	t.Cleanup(func() {
		req, _ := http.NewRequest(http.MethodDelete, ps.base+"/v1/projects/"+ps.project+"/subscriptions/"+s.sub, nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	})
	return s
}

// snapshot creates a snapshot of the subscription: its unacked backlog now
// and every message published after it.
func (s *replaySub) snapshot(t *testing.T, name string) {
	s.ps.do(t, http.MethodPut, "/snapshots/"+name, map[string]any{
		"subscription": "projects/" + s.ps.project + "/subscriptions/" + s.sub,
	}, nil)
}

// seekToSnapshot is gcloud pubsub subscriptions seek SUB --snapshot=NAME.
func (s *replaySub) seekToSnapshot(t *testing.T, name string) {
	s.ps.do(t, http.MethodPost, "/subscriptions/"+s.sub+":seek", map[string]any{
		"snapshot": "projects/" + s.ps.project + "/snapshots/" + name,
	}, nil)
}

// seekToTime is gcloud pubsub subscriptions seek SUB --time=T.
func (s *replaySub) seekToTime(t *testing.T, at time.Time) {
	s.ps.do(t, http.MethodPost, "/subscriptions/"+s.sub+":seek", map[string]any{
		"time": at.UTC().Format(time.RFC3339Nano),
	}, nil)
}

// replayOrders are the orders of a replay scenario; the bug hit
// replayAffected.
var (
	replayOrders   = []string{"PO-1", "PO-2", "PO-3", "PO-4", "PO-5"}
	replayAffected = []string{"PO-2", "PO-4"}
)

// publishOrders publishes each order once with its po_id attribute.
func (s *replaySub) publishOrders(t *testing.T) map[string]string {
	ids := map[string]string{}
	for _, po := range replayOrders {
		ids[po] = s.ps.publish(t, s.topic, map[string]string{"po_id": po}, order(po))
	}
	return ids
}

// checkPhase checks that every delivery of a phase was acked (204), that
// each order was delivered exactly once, that the body ran for exactly
// wantRuns (order -> stored key) with version, and that every other
// delivery was suppressed as a duplicate.
func checkPhase(t *testing.T, what string, p phase, version int, wantRuns map[string]string) {
	t.Helper()
	var pos []string
	for _, d := range p.deliveries {
		if d.status != http.StatusNoContent {
			t.Errorf("%s: %s (messageId %s) answered %d, want 204 (acked)", what, d.po, d.messageID, d.status)
		}
		pos = append(pos, d.po)
	}
	slices.Sort(pos)
	if !slices.Equal(pos, replayOrders) {
		t.Errorf("%s: deliveries of %v, want each of %v once", what, pos, replayOrders)
	}
	got := map[string]string{}
	for _, r := range p.runs {
		if _, dup := got[r.po]; dup {
			t.Errorf("%s: the body ran twice for %s", what, r.po)
		}
		got[r.po] = r.key
		if r.version != version {
			t.Errorf("%s: %s ran version %d, want %d", what, r.po, r.version, version)
		}
	}
	if fmt.Sprint(got) != fmt.Sprint(wantRuns) {
		t.Errorf("%s: the body ran for %v (order: key), want %v", what, got, wantRuns)
	}
	if want := len(replayOrders) - len(wantRuns); len(p.dups) != want {
		t.Errorf("%s: %d duplicates suppressed (%v), want %d", what, len(p.dups), p.dups, want)
	}
}

// keysOf returns, for each order of pos, the key key(order) names.
func keysOf(pos []string, key func(po string) string) map[string]string {
	m := map[string]string{}
	for _, po := range pos {
		m[po] = key(po)
	}
	return m
}

// forget deletes the Done record of each key, as the docs' procedure does:
// Inspect it, check it is Done, Forget exactly what was read.
func forget(t *testing.T, b store.Backend, keys []string) {
	t.Helper()
	insp, ok1 := b.(store.Inspector)
	fg, ok2 := b.(store.Forgetter)
	if !ok1 || !ok2 {
		t.Fatalf("%T does not implement store.Inspector and store.Forgetter", b)
	}
	ctx := context.Background()
	for _, key := range keys {
		rec, ok, err := insp.Inspect(ctx, key)
		if err != nil || !ok {
			t.Fatalf("Inspect(%q) = %+v, %v, %v; want its record", key, rec, ok, err)
		}
		if rec.State != store.Done {
			t.Fatalf("Inspect(%q): state %v, want Done", key, rec.State)
		}
		if gone, err := fg.Forget(ctx, rec); err != nil || !gone {
			t.Fatalf("Forget(%+v) = %v, %v; want true", rec, gone, err)
		}
		if rec, ok, err := insp.Inspect(ctx, key); err != nil || ok {
			t.Fatalf("after Forget, Inspect(%q) = %+v, %v, %v; want no record", key, rec, ok, err)
		}
	}
}

// TestReplayAfterAFix runs the docs' replay procedures on the emulator,
// over the fake store (whose clock the test moves past the ttl), keyed by
// a business key and by the default messageId.
func TestReplayAfterAFix(t *testing.T) {
	for _, tc := range []struct {
		name     string
		business bool // key by the po_id attribute, else by messageId
	}{
		{"business key", true},
		{"messageId key", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const ttl = time.Hour
			clock := fake.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
			b := fake.New(fake.WithClock(clock.Now), fake.WithTTL(ttl))
			c := newReplayConsumer(t)
			s := newReplaySub(t, "replay", c, true)
			var keyOpt []idempotency.Option
			if tc.business {
				keyOpt = append(keyOpt, idempotency.WithKey(idempotency.Attribute("po_id")))
			}
			deploy := func(version int, prefix string) {
				c.deploy(version, b, append(slices.Clone(keyOpt), idempotency.WithKeyPrefix(prefix))...)
			}
			var ids map[string]string // po_id -> messageId
			key := func(prefix string) func(po string) string {
				return func(po string) string {
					if tc.business {
						return prefix + po
					}
					return prefix + ids[po]
				}
			}

			// Version 1, with the bug, processes and acks every order.
			deploy(1, "orders:")
			s.snapshot(t, "before-orders")
			m := c.mark()
			ids = s.publishOrders(t)
			first := c.settle(t, m, len(replayOrders))
			checkPhase(t, "first delivery", first, 1, keysOf(replayOrders, key("orders:")))
			oldest := first.deliveries[0].published
			for _, d := range first.deliveries {
				if d.published.Before(oldest) {
					oldest = d.published
				}
			}
			if oldest.IsZero() {
				t.Fatal("the deliveries carry no publishTime")
			}

			// (a) The fix is deployed and the subscription seeks back to the
			// snapshot: every order is delivered again, with its messageId,
			// and acked as a duplicate; the fixed handler runs for none.
			deploy(2, "orders:")
			m = c.mark()
			s.seekToSnapshot(t, "before-orders")
			p := c.settle(t, m, len(replayOrders))
			checkPhase(t, "(a) seek without forgetting", p, 2, nil)
			for _, d := range p.deliveries {
				if ids[d.po] != d.messageID {
					t.Errorf("(a) %s came back with messageId %s, published as %s", d.po, d.messageID, ids[d.po])
				}
			}

			// (b) Forget the affected keys, then seek back to a time before
			// the orders were published: the handler runs again for exactly
			// those keys, the others are acked as duplicates.
			forget(t, b, slices.Collect(func(yield func(string) bool) {
				for _, po := range replayAffected {
					if !yield(key("orders:")(po)) {
						return
					}
				}
			}))
			m = c.mark()
			s.seekToTime(t, oldest.Add(-time.Millisecond))
			p = c.settle(t, m, len(replayOrders))
			checkPhase(t, "(b) forget the affected keys, then seek to a time", p, 2, keysOf(replayAffected, key("orders:")))

			// (c) A new key prefix: every order runs again, the ones the bug
			// did not touch included.
			deploy(2, "orders-v2:")
			m = c.mark()
			s.seekToSnapshot(t, "before-orders")
			p = c.settle(t, m, len(replayOrders))
			checkPhase(t, "(c) a new key prefix, then seek", p, 2, keysOf(replayOrders, key("orders-v2:")))

			// Republishing is not a seek: each copy gets a new messageId.
			// A business key suppresses the copies; the messageId key runs
			// every one of them.
			m = c.mark()
			republished := s.publishOrders(t)
			p = c.settle(t, m, len(replayOrders))
			if tc.business {
				checkPhase(t, "republish, business key", p, 2, nil)
			} else {
				for po, id := range republished {
					if id == ids[po] {
						t.Fatalf("the republish of %s reused messageId %s", po, id)
					}
				}
				ids = republished
				checkPhase(t, "republish, messageId key", p, 2, keysOf(replayOrders, key("orders-v2:")))
			}

			// (d) Once the ttl has passed (by the store's clock), a seek
			// replays every order without any other step.
			clock.Advance(ttl + time.Second)
			m = c.mark()
			s.seekToSnapshot(t, "before-orders")
			p = c.settle(t, m, len(replayOrders)*2)
			if !tc.business {
				// The seek brings back the first publishes and the
				// republished copies: ten messages, ten keys, ten runs.
				runs := map[string]int{}
				for _, r := range p.runs {
					runs[r.key]++
				}
				for _, po := range replayOrders {
					for _, k := range []string{key("orders-v2:")(po), "orders-v2:" + first.idOf(po)} {
						if runs[k] != 1 {
							t.Errorf("(d) after the ttl, key %s (%s) ran %d times, want 1", k, po, runs[k])
						}
					}
				}
				if len(p.runs) != 2*len(replayOrders) || len(p.dups) != 0 {
					t.Errorf("(d) %d runs, %d duplicates; want %d and 0", len(p.runs), len(p.dups), 2*len(replayOrders))
				}
				return
			}
			// With a business key, the two copies of an order are one key:
			// the first to arrive runs, the other is a duplicate.
			runs := map[string]int{}
			for _, r := range p.runs {
				runs[r.po]++
				if r.key != "orders-v2:"+r.po {
					t.Errorf("(d) %s ran under key %s", r.po, r.key)
				}
			}
			for _, po := range replayOrders {
				if runs[po] != 1 {
					t.Errorf("(d) after the ttl, %s ran %d times, want 1 (runs %v)", po, runs[po], p.runs)
				}
			}
			if len(p.dups) != len(replayOrders) || len(p.deliveries) != 2*len(replayOrders) {
				t.Errorf("(d) %d deliveries, %d duplicates; want %d and %d", len(p.deliveries), len(p.dups), 2*len(replayOrders), len(replayOrders))
			}
		})
	}
}

// TestReplayAfterAFixOnRedis runs the seek replays that need no Forget on
// a real store, Redis: a seek is suppressed, a new key prefix runs every
// order again. Its subscription does not retain acked messages: a seek to
// a time then replays nothing, and a seek to a snapshot still replays
// every message published after the snapshot.
func TestReplayAfterAFixOnRedis(t *testing.T) {
	client := redis.NewClient(&redis.Options{Addr: testsvc.Redis(t)})
	t.Cleanup(func() { client.Close() })
	b, err := redislock.New(client, redislock.WithPrefix(fmt.Sprintf("e2e-replay-%d:", time.Now().UnixNano())))
	if err != nil {
		t.Fatal(err)
	}
	c := newReplayConsumer(t)
	s := newReplaySub(t, "replayredis", c, false)
	keyOpt := idempotency.WithKey(idempotency.Attribute("po_id"))
	business := func(prefix string) func(string) string { return func(po string) string { return prefix + po } }

	c.deploy(1, b, keyOpt, idempotency.WithKeyPrefix("orders:"))
	s.snapshot(t, "before-orders")
	m := c.mark()
	s.publishOrders(t)
	first := c.settle(t, m, len(replayOrders))
	checkPhase(t, "first delivery", first, 1, keysOf(replayOrders, business("orders:")))

	// Without acked-message retention the acked orders are gone: a seek to
	// a time before them delivers nothing (within the settling time).
	m = c.mark()
	s.seekToTime(t, first.deliveries[0].published.Add(-time.Second))
	if p := c.settle(t, m, 0); len(p.deliveries) != 0 {
		t.Errorf("a seek to a time on a subscription that keeps no acked message delivered %d messages", len(p.deliveries))
	}

	c.deploy(2, b, keyOpt, idempotency.WithKeyPrefix("orders:"))
	m = c.mark()
	s.seekToSnapshot(t, "before-orders")
	checkPhase(t, "(a) seek without forgetting", c.settle(t, m, len(replayOrders)), 2, nil)

	c.deploy(2, b, keyOpt, idempotency.WithKeyPrefix("orders-v2:"))
	m = c.mark()
	s.seekToSnapshot(t, "before-orders")
	checkPhase(t, "(c) a new key prefix, then seek", c.settle(t, m, len(replayOrders)), 2, keysOf(replayOrders, business("orders-v2:")))
}
