package pubsubtest_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/GoogleCloudPlatform/functions-framework-go/funcframework"
	cloudevents "github.com/cloudevents/sdk-go/v2"
	"github.com/google/go-cmp/cmp"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/ffserve"
	"github.com/gcp-pubsub-idempotency/idempotency/pubsubtest"
)

// The functions framework serves one function per test binary; it runs
// whatever the running test installed (the tests here run one at a time).
var (
	frameworkURL string
	fnMu         sync.Mutex
	fn           idempotency.CloudEventFunc
)

func TestMain(m *testing.M) {
	os.Unsetenv("FUNCTION_TARGET")
	dispatch := func(ctx context.Context, e cloudevents.Event) error {
		fnMu.Lock()
		f := fn
		fnMu.Unlock()
		return f(ctx, e)
	}
	if err := funcframework.RegisterCloudEventFunctionContext(context.Background(), "/", dispatch); err != nil {
		fmt.Fprintln(os.Stderr, "register:", err)
		os.Exit(2)
	}
	url, _, err := ffserve.Start("")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	frameworkURL = url
	os.Exit(m.Run())
}

// serve makes f the framework's function for the rest of the test.
func serve(t *testing.T, f idempotency.CloudEventFunc) {
	fnMu.Lock()
	fn = f
	fnMu.Unlock()
	t.Cleanup(func() {
		fnMu.Lock()
		fn = nil
		fnMu.Unlock()
	})
}

// throughFramework posts r to the functions framework and returns the
// status and the body.
func throughFramework(t *testing.T, r *http.Request) (int, string) {
	t.Helper()
	resp, err := pubsubtest.Send(frameworkURL, r)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// throughPushHandler serves r with h and returns the status and the body.
func throughPushHandler(h http.Handler, r *http.Request) (int, string) {
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w.Code, w.Body.String()
}

// capture records the events a handler receives.
type capture struct {
	mu     sync.Mutex
	events []cloudevents.Event
}

func (c *capture) handle(_ context.Context, e cloudevents.Event) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.events = append(c.events, e)
	return nil
}

func (c *capture) runs() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.events)
}

// only returns the one event c received.
func (c *capture) only(t *testing.T) cloudevents.Event {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.events) != 1 {
		t.Fatalf("the handler received %d events, want 1", len(c.events))
	}
	return c.events[0]
}

func quiet() idempotency.Option {
	return idempotency.WithLogger(slog.New(slog.DiscardHandler))
}

// full is a message with every field set.
func full() pubsubtest.Message {
	return pubsubtest.Message{
		ID:              "4242424242424242",
		Data:            []byte(`{"order":{"id":"PO-7","note":"<a&b>"}}`),
		Attributes:      map[string]string{"po_id": "PO-7", "source": "erp"},
		OrderingKey:     "customer-9",
		PublishTime:     time.Date(2026, 11, 29, 12, 0, 0, 123_000_000, time.FixedZone("CET", 3600)),
		DeliveryAttempt: 3,
		Topic:           "projects/p/topics/orders",
		Subscription:    "projects/p/subscriptions/orders-push",
	}
}

// parsed is what idempotency.ParsePubSub must read from any shape of m.
func parsed(m pubsubtest.Message) idempotency.PubSubEvent {
	return idempotency.PubSubEvent{
		Message: idempotency.PubSubMessage{
			ID:          m.ID,
			Data:        m.Data,
			Attributes:  m.Attributes,
			OrderingKey: m.OrderingKey,
			PublishTime: m.PublishTime,
		},
		Subscription:    m.Subscription,
		DeliveryAttempt: m.DeliveryAttempt,
	}
}

func parse(t *testing.T, e cloudevents.Event) idempotency.PubSubEvent {
	t.Helper()
	got, err := idempotency.ParsePubSub(e)
	if err != nil {
		t.Fatalf("ParsePubSub: %v", err)
	}
	return got
}

// shapes are the builders that make an HTTP request.
var shapes = []struct {
	name  string
	build func(*pubsubtest.Message) *http.Request
}{
	{"binary", (*pubsubtest.Message).BinaryRequest},
	{"structured", (*pubsubtest.Message).StructuredRequest},
	{"push", (*pubsubtest.Message).PushRequest},
}

// TestEveryShapeCarriesTheMessage: ParsePubSub reads every field of the
// message back from Event, and from each request as PushHandler and the
// functions framework hand it to the function; the framework's conversion
// of a push envelope drops the subscription, the delivery attempt and the
// ordering key, as the package doc says.
func TestEveryShapeCarriesTheMessage(t *testing.T) {
	m := full()
	want := parsed(m)
	if diff := cmp.Diff(want, parse(t, m.Event())); diff != "" {
		t.Errorf("ParsePubSub(Event()) (-want +got):\n%s", diff)
	}
	for _, s := range shapes {
		t.Run(s.name+"/PushHandler", func(t *testing.T) {
			c := &capture{}
			code, body := throughPushHandler(idempotency.PushHandler(fake.New(), c.handle, quiet()), s.build(&m))
			if code != http.StatusNoContent {
				t.Fatalf("HTTP %d %s, want 204", code, body)
			}
			if diff := cmp.Diff(want, parse(t, c.only(t))); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
		t.Run(s.name+"/framework", func(t *testing.T) {
			c := &capture{}
			serve(t, idempotency.Idempotent(fake.New(), quiet())(c.handle))
			if code, body := throughFramework(t, s.build(&m)); code != http.StatusOK {
				t.Fatalf("HTTP %d %s, want 200", code, body)
			}
			w := want
			if s.name == "push" {
				w.Subscription, w.DeliveryAttempt, w.Message.OrderingKey = "", 0, ""
			}
			if diff := cmp.Diff(w, parse(t, c.only(t))); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

// TestEventIsWhatTheFrameworkPassesForTheBinaryRequest: a function called
// with Event() gets the event the framework makes of BinaryRequest().
func TestEventIsWhatTheFrameworkPassesForTheBinaryRequest(t *testing.T) {
	m := full()
	c := &capture{}
	serve(t, c.handle)
	if code, body := throughFramework(t, m.BinaryRequest()); code != http.StatusOK {
		t.Fatalf("HTTP %d %s", code, body)
	}
	got, want := c.only(t), m.Event()
	if got.ID() != want.ID() || got.Source() != want.Source() || got.Type() != want.Type() ||
		!got.Time().Equal(want.Time()) || got.SpecVersion() != want.SpecVersion() ||
		got.DataContentType() != want.DataContentType() || !bytes.Equal(got.Data(), want.Data()) ||
		got.DataBase64 != want.DataBase64 || len(got.Extensions()) != len(want.Extensions()) {
		t.Errorf("the framework passed\n%v\nEvent() is\n%v", got, want)
	}
	if err := want.Validate(); err != nil {
		t.Errorf("Event() is not a valid CloudEvent: %v", err)
	}
}

// fixture reads ../testdata/name.http: the request line and headers, and
// the body.
func fixture(t *testing.T, name string) (*http.Request, []byte) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "testdata", name+".http"))
	if err != nil {
		t.Fatal(err)
	}
	head, body, ok := bytes.Cut(raw, []byte("\n\n"))
	if !ok {
		t.Fatalf("%s: no blank line after the headers", name)
	}
	req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(append(head, "\n\n"...))))
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return req, bytes.TrimRight(body, "\n")
}

// TestShapesMatchTheFixtures: built from the fields of the real-shaped
// requests in testdata/, each builder makes that request: the same method,
// path, headers and body.
func TestShapesMatchTheFixtures(t *testing.T) {
	order := pubsubtest.Message{
		ID:           "11223344556677",
		Data:         []byte(`{"order":{"id":"PO-1001","qty":3}}`),
		Attributes:   map[string]string{"po_id": "PO-1001", "source": "erp"},
		PublishTime:  time.Date(2026, 11, 29, 12, 0, 0, 123_000_000, time.UTC),
		Topic:        "projects/my-project/topics/orders",
		Subscription: "projects/my-project/subscriptions/orders-push",
	}
	eventarc := order
	eventarc.Subscription = "projects/my-project/subscriptions/eventarc-us-central1-handle-order-123-sub-456"
	eventarc.DeliveryAttempt = 5
	republish := eventarc.Republished()
	republish.ID, republish.DeliveryAttempt = "99999999999999", 1
	republish.PublishTime = time.Date(2026, 11, 29, 12, 5, 0, 0, time.UTC)

	cases := []struct {
		fixture string
		req     *http.Request
		jsonEq  bool // the body equals the fixture's as JSON, not byte for byte
	}{
		{"eventarc_binary", eventarc.BinaryRequest(), false},
		{"republish", republish.BinaryRequest(), true},
		{"push_raw", order.PushRequest(), false},
		{"eventarc_structured", order.StructuredRequest(), true},
	}
	for _, c := range cases {
		t.Run(c.fixture, func(t *testing.T) {
			want, wantBody := fixture(t, c.fixture)
			if c.req.Method != want.Method || c.req.URL.Path != want.URL.Path {
				t.Errorf("%s %s, want %s %s", c.req.Method, c.req.URL.Path, want.Method, want.URL.Path)
			}
			for k := range want.Header {
				if k == "Traceparent" {
					continue // Eventarc's trace context: no part of the message
				}
				if got := c.req.Header.Get(k); got != want.Header.Get(k) {
					t.Errorf("header %s = %q, want %q", k, got, want.Header.Get(k))
				}
			}
			for k := range c.req.Header {
				if strings.HasPrefix(k, "Ce-") && want.Header.Get(k) == "" {
					t.Errorf("header %s = %q, which the fixture does not have", k, c.req.Header.Get(k))
				}
			}
			body, _ := io.ReadAll(c.req.Body)
			if c.jsonEq {
				var got, exp any
				if err := json.Unmarshal(body, &got); err != nil {
					t.Fatal(err)
				}
				if err := json.Unmarshal(wantBody, &exp); err != nil {
					t.Fatal(err)
				}
				dropSnakeCaseTwins(t, got, exp)
				if diff := cmp.Diff(exp, got); diff != "" {
					t.Errorf("body (-fixture +built):\n%s", diff)
				}
			} else if !bytes.Equal(body, wantBody) {
				t.Errorf("body\n%s\nfixture\n%s", body, wantBody)
			}
		})
	}
}

// dropSnakeCaseTwins removes message_id and publish_time from the message
// of the built body where the fixture has only messageId and publishTime
// (ParsePubSub reads either), after checking that each equals its twin.
func dropSnakeCaseTwins(t *testing.T, built, fixture any) {
	t.Helper()
	message := func(v any) map[string]any {
		body, _ := v.(map[string]any)
		if data, ok := body["data"].(map[string]any); ok { // a structured CloudEvent
			body = data
		}
		m, _ := body["message"].(map[string]any)
		return m
	}
	b, f := message(built), message(fixture)
	for snake, camel := range map[string]string{"message_id": "messageId", "publish_time": "publishTime"} {
		if _, ok := f[snake]; ok || b == nil {
			continue
		}
		if v, ok := b[snake]; ok {
			if v != b[camel] {
				t.Errorf("%s = %v, %s = %v", snake, v, camel, b[camel])
			}
			delete(b, snake)
		}
	}
}

var pubsubIDRE = regexp.MustCompile(`^[1-9][0-9]{15}$`)

// TestAZeroMessageGetsAFreshIDThatItKeeps: the first build of a Message
// without ID or PublishTime fills both in, every later build of it (in any
// shape) reuses them, and another Message gets another ID.
func TestAZeroMessageGetsAFreshIDThatItKeeps(t *testing.T) {
	var m pubsubtest.Message
	first := parse(t, m.Event())
	if !pubsubIDRE.MatchString(first.Message.ID) || m.ID != first.Message.ID {
		t.Fatalf("Event() gave the id %q and kept %q, want one 16-digit id", first.Message.ID, m.ID)
	}
	if first.Message.PublishTime.IsZero() || !m.PublishTime.Equal(first.Message.PublishTime) {
		t.Fatalf("publish time %v, kept %v", first.Message.PublishTime, m.PublishTime)
	}
	if first.Subscription != pubsubtest.DefaultSubscription || first.Message.Data != nil || first.Message.Attributes != nil {
		t.Fatalf("zero message parsed as %+v", first)
	}
	if src := m.Event().Source(); src != "//pubsub.googleapis.com/"+pubsubtest.DefaultTopic {
		t.Errorf("source %q", src)
	}
	for _, s := range shapes {
		c := &capture{}
		throughPushHandler(idempotency.PushHandler(fake.New(), c.handle, quiet()), s.build(&m))
		if diff := cmp.Diff(first, parse(t, c.only(t))); diff != "" {
			t.Errorf("%s: (-first build +this one):\n%s", s.name, diff)
		}
	}
	if h := m.UnwrappedRequest(true).Header.Get(pubsubtest.HeaderMessageID); h != first.Message.ID {
		t.Errorf("unwrapped message id %q, want %q", h, first.Message.ID)
	}
	var other pubsubtest.Message
	if id := other.Event().ID(); id == first.Message.ID {
		t.Errorf("two zero messages share the id %q", id)
	}
}

// TestConcurrentBuildsOfOneMessageAgree: goroutines that build one zero
// Message at once (a test of concurrent duplicates) all get the same id.
func TestConcurrentBuildsOfOneMessageAgree(t *testing.T) {
	var m pubsubtest.Message
	ids := make([]string, 32)
	var wg sync.WaitGroup
	for i := range ids {
		wg.Go(func() {
			switch i % 3 {
			case 0:
				ids[i] = m.Event().ID()
			case 1:
				ids[i] = m.BinaryRequest().Header.Get("Ce-Id")
			default:
				ids[i] = m.UnwrappedRequest(true).Header.Get(pubsubtest.HeaderMessageID)
			}
		})
	}
	wg.Wait()
	for i, id := range ids {
		if id == "" || id != ids[0] {
			t.Fatalf("build %d gave the id %q, build 0 %q", i, id, ids[0])
		}
	}
}

// TestUnwrappedRequest: with payload unwrapping the body is the data byte
// for byte; write metadata adds the attributes and the four metadata
// headers (the ordering key only when set), nothing else.
func TestUnwrappedRequest(t *testing.T) {
	m := full()
	m.Data = []byte{0, 1, 2, 0xff, '\n'} // not JSON, not UTF-8: sent as is
	m.Attributes["Content-Type"] = "application/octet-stream"
	m.Attributes[pubsubtest.HeaderMessageID] = "forged"

	bare := m.UnwrappedRequest(false)
	if body, _ := io.ReadAll(bare.Body); !bytes.Equal(body, m.Data) {
		t.Errorf("body %q, want %q", body, m.Data)
	}
	for k := range bare.Header {
		if k != "User-Agent" {
			t.Errorf("without metadata, header %s = %q", k, bare.Header.Get(k))
		}
	}

	r := m.UnwrappedRequest(true)
	if body, _ := io.ReadAll(r.Body); !bytes.Equal(body, m.Data) {
		t.Errorf("body %q, want %q", body, m.Data)
	}
	want := http.Header{}
	want.Set("User-Agent", "CloudPubSub-Google")
	want.Set("po_id", "PO-7")
	want.Set("source", "erp")
	want.Set("Content-Type", "application/octet-stream")
	want.Set("X-Goog-Pubsub-Message-Id", "4242424242424242") // the metadata overwrites the attribute
	want.Set("X-Goog-Pubsub-Subscription-Name", "projects/p/subscriptions/orders-push")
	want.Set("X-Goog-Pubsub-Publish-Time", "2026-11-29T11:00:00.123Z")
	want.Set("X-Goog-Pubsub-Ordering-Key", "customer-9")
	if diff := cmp.Diff(want, r.Header); diff != "" {
		t.Errorf("headers (-want +got):\n%s", diff)
	}

	m.OrderingKey = ""
	if _, ok := m.UnwrappedRequest(true).Header[http.CanonicalHeaderKey(pubsubtest.HeaderOrderingKey)]; ok {
		t.Error("an ordering key header for a message without one")
	}
}

// TestDeliveredInEveryShapeRunsOnce: one message, delivered in every shape
// through the framework and PushHandler over one backend, runs its body
// once and is acked every time: every shape carries the same key.
func TestDeliveredInEveryShapeRunsOnce(t *testing.T) {
	backend := fake.New()
	c := &capture{}
	serve(t, idempotency.Idempotent(backend, quiet())(c.handle))
	ph := idempotency.PushHandler(backend, c.handle, quiet())
	m := pubsubtest.Message{Data: []byte("hello")}
	for _, s := range shapes {
		if code, body := throughFramework(t, s.build(&m)); code != http.StatusOK {
			t.Fatalf("%s through the framework: HTTP %d %s", s.name, code, body)
		}
		if code, body := throughPushHandler(ph, s.build(&m)); code != http.StatusNoContent {
			t.Fatalf("%s through PushHandler: HTTP %d %s", s.name, code, body)
		}
	}
	if err := idempotency.Idempotent(backend, quiet())(c.handle)(t.Context(), m.Event()); err != nil {
		t.Fatalf("Event() called directly: %v", err)
	}
	if c.runs() != 1 || backend.Len() != 1 {
		t.Fatalf("the body ran %d times, %d records; want once, one record", c.runs(), backend.Len())
	}
	if rec, ok := backend.Record(m.ID); !ok || rec.State.String() != "done" {
		t.Fatalf("record %q: %+v (present %v)", m.ID, rec, ok)
	}
}

// TestRepublishedIsANewPublishOfTheSameContent: a republish has a new
// messageId and the same content, so the default key runs it again and a
// business key does not; changing it leaves the original alone.
func TestRepublishedIsANewPublishOfTheSameContent(t *testing.T) {
	m := full()
	r := m.Republished()
	orig, again := parse(t, m.Event()), parse(t, r.Event())
	if again.Message.ID == orig.Message.ID || !pubsubIDRE.MatchString(again.Message.ID) {
		t.Fatalf("republished id %q, original %q", again.Message.ID, orig.Message.ID)
	}
	if again.DeliveryAttempt != 0 || again.Message.PublishTime.Equal(orig.Message.PublishTime) {
		t.Errorf("republish kept the delivery attempt %d or the publish time %v", again.DeliveryAttempt, again.Message.PublishTime)
	}
	if !bytes.Equal(again.Message.Data, orig.Message.Data) || !cmp.Equal(again.Message.Attributes, orig.Message.Attributes) ||
		again.Message.OrderingKey != orig.Message.OrderingKey || again.Subscription != orig.Subscription {
		t.Errorf("republish changed the content: %+v, original %+v", again, orig)
	}
	for _, c := range []struct {
		name string
		opts []idempotency.Option
		runs int
	}{
		{"by messageId", nil, 2},
		{"by po_id", []idempotency.Option{idempotency.WithKey(idempotency.Attribute("po_id"))}, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := &capture{}
			fn := idempotency.Idempotent(fake.New(), append(c.opts, quiet())...)(h.handle)
			for _, e := range []cloudevents.Event{m.Event(), r.Event()} {
				if err := fn(t.Context(), e); err != nil {
					t.Fatal(err)
				}
			}
			if h.runs() != c.runs {
				t.Fatalf("ran %d times, want %d", h.runs(), c.runs)
			}
		})
	}
	r.Attributes["po_id"] = "PO-8"
	r.Data[0] = 'X'
	if m.Attributes["po_id"] != "PO-7" || m.Data[0] != '{' {
		t.Error("changing the republish changed the original")
	}
}

// TestREADMETestingSectionIsAnExample: the Go code in the README's
// "Testing your handler" section is, line for line, an example of this
// package that go test compiles and runs.
func TestREADMETestingSectionIsAnExample(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(readme), "\n## Testing your handler\n")
	if !ok {
		t.Fatal("README.md has no section \"Testing your handler\"")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	_, code, ok := strings.Cut(section, "```go\n")
	if !ok {
		t.Fatal("the testing section has no Go code block")
	}
	code, _, _ = strings.Cut(code, "```")
	if !strings.HasPrefix(code, "func Example") {
		t.Fatalf("the testing section's code is not an example function:\n%s", code)
	}
	examples, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(examples), "\n"+code) {
		t.Fatalf("example_test.go does not contain the README's code:\n%s", code)
	}
}

// TestUnwrappedRequestThroughPushHandler: PushHandler with
// WithUnwrappedPush reads back from UnwrappedRequest(true) everything
// Pub/Sub writes (no delivery attempt), and keys it on the message id
// header; UnwrappedRequest(false) has no message id, so only a payload key
// works; both run the body once for two deliveries. The header names are
// PushHandler's.
func TestUnwrappedRequestThroughPushHandler(t *testing.T) {
	for mine, theirs := range map[string]string{
		pubsubtest.HeaderMessageID:    idempotency.PushMessageIDHeader,
		pubsubtest.HeaderSubscription: idempotency.PushSubscriptionHeader,
		pubsubtest.HeaderPublishTime:  idempotency.PushPublishTimeHeader,
		pubsubtest.HeaderOrderingKey:  idempotency.PushOrderingKeyHeader,
	} {
		if http.CanonicalHeaderKey(mine) != theirs {
			t.Errorf("pubsubtest writes %s, PushHandler reads %s", mine, theirs)
		}
	}

	m := full()
	want := parsed(m)
	want.DeliveryAttempt = 0
	c := &capture{}
	backend := fake.New()
	h := idempotency.PushHandler(backend, c.handle, quiet(), idempotency.WithUnwrappedPush("po_id", "source"))
	for range 2 {
		if code, body := throughPushHandler(h, m.UnwrappedRequest(true)); code != http.StatusNoContent {
			t.Fatalf("with metadata: HTTP %d %s", code, body)
		}
	}
	if diff := cmp.Diff(want, parse(t, c.only(t))); diff != "" {
		t.Errorf("with metadata (-want +got):\n%s", diff)
	}
	if _, ok := backend.Record(m.ID); !ok {
		t.Errorf("no record under the message id %q", m.ID)
	}

	code, body := throughPushHandler(idempotency.PushHandler(fake.New(), c.handle, quiet(), idempotency.WithUnwrappedPush()), m.UnwrappedRequest(false))
	if code != http.StatusBadRequest || !strings.Contains(body, idempotency.ErrNoKey.Error()) {
		t.Errorf("without metadata, default key: HTTP %d %s; want 400 naming ErrNoKey", code, body)
	}
	c = &capture{}
	h = idempotency.PushHandler(fake.New(), c.handle, quiet(), idempotency.WithUnwrappedPush(),
		idempotency.WithKey(idempotency.JSONField("order", "id")))
	for range 2 {
		if code, body := throughPushHandler(h, m.UnwrappedRequest(false)); code != http.StatusNoContent {
			t.Fatalf("without metadata, payload key: HTTP %d %s", code, body)
		}
	}
	if got := parse(t, c.only(t)).Message.Data; !bytes.Equal(got, m.Data) {
		t.Errorf("the handler got the data %q, want %q", got, m.Data)
	}
}
