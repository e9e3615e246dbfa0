package pubsubtest_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/pubsubtest"
)

func Example() {
	backend := fake.New() // a complete backend, in memory
	sends := 0
	handleOrder := func(ctx context.Context, e cloudevents.Event) error {
		sends++ // your handler's side effect
		return nil
	}
	fn := idempotency.Idempotent(backend)(handleOrder)

	m := pubsubtest.Message{ID: "m-1", Data: []byte(`{"order":{"id":"PO-1"}}`)}
	fmt.Println(fn(context.Background(), m.Event())) // the delivery: runs
	fmt.Println(fn(context.Background(), m.Event())) // a redelivery: skipped, acked
	rec, _ := backend.Record("m-1")
	fmt.Println("sends:", sends, "record:", rec.State)
	// Output:
	// <nil>
	// <nil>
	// sends: 1 record: done
}

func ExampleMessage_PushRequest() {
	// A Cloud Run service without the functions framework: PushHandler
	// takes the raw push envelope and the Eventarc shapes alike.
	sends := 0
	h := idempotency.PushHandler(fake.New(), func(ctx context.Context, e cloudevents.Event) error {
		sends++
		return nil
	})
	m := pubsubtest.Message{Attributes: map[string]string{"po_id": "PO-2"}} // a fresh messageId
	for _, r := range []*httptest.ResponseRecorder{httptest.NewRecorder(), httptest.NewRecorder()} {
		h.ServeHTTP(r, m.PushRequest()) // the same message, twice
		fmt.Println("HTTP", r.Code)
	}
	fmt.Println("sends:", sends)
	// Output:
	// HTTP 204
	// HTTP 204
	// sends: 1
}

func ExampleMessage_Republished() {
	// A producer publishes the same order twice: two messageIds. Keyed by
	// the order's attribute, it still runs once.
	sends := 0
	fn := idempotency.Idempotent(fake.New(), idempotency.WithKey(idempotency.Attribute("po_id")))(
		func(ctx context.Context, e cloudevents.Event) error {
			sends++
			return nil
		})
	first := pubsubtest.Message{Attributes: map[string]string{"po_id": "PO-3"}}
	again := first.Republished()
	_ = fn(context.Background(), first.Event())
	_ = fn(context.Background(), again.Event())
	fmt.Println("new messageId:", again.ID != first.ID, "sends:", sends)
	// Output:
	// new messageId: true sends: 1
}

func ExampleMessage_UnwrappedRequest() {
	m := pubsubtest.Message{
		ID:           "1234567890123456",
		Data:         []byte("raw bytes"),
		Attributes:   map[string]string{"po_id": "PO-4"},
		Subscription: "projects/p/subscriptions/orders-unwrapped",
	}
	r := m.UnwrappedRequest(true) // --push-no-wrapper --push-no-wrapper-write-metadata
	fmt.Println(r.Header.Get(pubsubtest.HeaderMessageID))
	fmt.Println(r.Header.Get(pubsubtest.HeaderSubscription))
	fmt.Println(r.Header.Get("po_id"))
	// Output:
	// 1234567890123456
	// projects/p/subscriptions/orders-unwrapped
	// PO-4
}

// What Pub/Sub does with a delivery, told from what the guarded function
// returned: 200 acks; a 503 (the key is being processed elsewhere) and a
// 500 (the handler failed) are redelivered.
func ExampleStatus() {
	backend := fake.New()
	failing := true
	fn := idempotency.Idempotent(backend, idempotency.WithLogger(slog.New(slog.DiscardHandler)))(
		func(ctx context.Context, e cloudevents.Event) error {
			if failing {
				return errors.New("supplier unreachable")
			}
			return nil
		})
	m := pubsubtest.Message{ID: "m-1"}
	fmt.Println(pubsubtest.Status(fn(context.Background(), m.Event()))) // the handler failed
	failing = false
	fmt.Println(pubsubtest.Status(fn(context.Background(), m.Event()))) // the redelivery succeeds
	fmt.Println(pubsubtest.Status(fn(context.Background(), m.Event()))) // a duplicate: acked

	backend.Claim(context.Background(), "m-2", time.Hour) // another instance holds m-2
	m2 := pubsubtest.Message{ID: "m-2"}
	fmt.Println(pubsubtest.Status(fn(context.Background(), m2.Event())))
	// Output:
	// 500
	// 200
	// 200
	// 503
}

// A guarded function served over HTTP, as the functions framework serves
// it, and stopped at the end of the test.
func ExampleNewServer() {
	runs := 0
	fn := idempotency.Idempotent(fake.New())(func(context.Context, cloudevents.Event) error { runs++; return nil })
	srv := pubsubtest.NewServer(fn)
	defer srv.Close()

	m := pubsubtest.Message{ID: "m-1"}
	for range 2 { // a delivery and its redelivery: both acked, the handler ran once
		resp, err := pubsubtest.Send(srv.URL, m.BinaryRequest())
		if err != nil {
			panic(err)
		}
		resp.Body.Close()
		fmt.Println(resp.StatusCode)
	}
	fmt.Println("runs:", runs)
	// Output:
	// 200
	// 200
	// runs: 1
}
